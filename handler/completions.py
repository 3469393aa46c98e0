"""POST /v1/completions (OpenAI's legacy shape), prefill only: validation, and the response from the engine's
per-position log-probabilities.

One prefill per prompt gives the log-probability of every prompt token after the first (`echo` with
`logprobs`), the most likely alternatives at each position, and at most one completion token: the most likely
one after the prompt (`temperature` 0) or one drawn from the same distribution (seeded). That is what
evaluation harnesses ask for: lm-evaluation-harness's `local-completions` sends `echo: true, logprobs: 1,
max_tokens: 1, temperature: 0` and reads `token_logprobs[ctxlen:-1]`. `max_tokens` absent (OpenAI's default is
16) or above 1 would be generation: 400 generation_not_supported.

Like vLLM, each position's `top_logprobs` holds the `logprobs` most likely tokens and the token itself, and
`text_offset` counts the characters of the tokens as each decodes alone, from the start of `text`.

Order: prompt (missing, type, empty, token range), max_tokens, echo, logprobs, temperature, top_p, seed, stop,
n, best_of, stream, suffix, presence_penalty, frequency_penalty, user, model, cache_salt; then too_many_items, and after
tokenization empty_sequence, context_length_exceeded, too_many_tokens. A JSON null counts as the field being absent.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time
import uuid

import msgspec

from handler import schemas
from handler.errors import ERRORS, ErrorSpec
from handler.http import Scoring, cached
from handler.validation import (InputsField, cache_salt, check_count, check_sequence, check_total_tokens, decode_inputs,
                                is_given, optional, require_language_model, served_model)
from runtime.interface import Sampling, ScoringEngine, TokenLogprobs, TokenLogprobsResult
from runtime.settings import Settings

MAX_LOGPROBS = 20  # OpenAI's limit (runtime.interface.MAX_TOP_LOGPROBS computes as many)
MAX_STOP = 4
_PROMPT = InputsField(ERRORS.missing_prompt, ERRORS.invalid_prompt_type, ERRORS.prompt_beyond_int64,
                      ERRORS.empty_prompt, ERRORS.empty_prompt_element)


@dataclasses.dataclass(frozen=True)
class CompletionJob:
    """A validated /v1/completions request, ready for the engine."""
    sequences: list[list[int]]  # one prompt per choice, each non-empty and within the length limit
    sampling: list[Sampling]
    texts: list[str] | None  # the prompts as given when they were text (echoed as is), else None
    max_tokens: int  # 0 or 1
    echo: bool
    logprobs: int | None  # alternatives per position; None: no logprobs object
    stop: tuple[str, ...]
    model: str
    n_tokens: int  # usage.prompt_tokens
    adapter: str | None = None  # the LoRA adapter `model` names (None: the base model)
    cache_salt: str | None = None  # the prefix cache's (runtime.requests.prefix_cache)


def validate_completion_request(request: schemas.CompletionRequest, engine: ScoringEngine,
                                settings: Settings) -> CompletionJob:
    require_language_model(engine)
    prompts, _ = decode_inputs(request.prompt, _PROMPT, engine.vocab_size, blank_ok=True)
    max_tokens = _max_tokens(request.max_tokens)
    echo = optional(request.echo, bool, ERRORS.invalid_echo_type, False)
    logprobs = _bounded(request.logprobs, int, ERRORS.invalid_logprobs_type, None, ERRORS.invalid_logprobs,
                        0, MAX_LOGPROBS)
    temperature = _bounded(request.temperature, float, ERRORS.invalid_temperature_type, 1.0,
                           ERRORS.invalid_temperature, 0.0, 2.0)
    _only(request.top_p, float, ERRORS.invalid_top_p_type, 1.0, ERRORS.invalid_top_p)
    seed = optional(request.seed, int, ERRORS.invalid_seed_type, None)
    stop = _stop(request.stop)
    _only(request.n, int, ERRORS.invalid_n_type, 1, ERRORS.invalid_n)
    _only(request.best_of, int, ERRORS.invalid_best_of_type, 1, ERRORS.invalid_best_of)
    if optional(request.stream, bool, ERRORS.invalid_stream_type, False):
        raise ERRORS.stream_not_supported()
    if optional(request.suffix, str, ERRORS.invalid_suffix_type, ""):
        raise ERRORS.suffix_not_supported()
    # The penalties cannot change a first token.
    _bounded(request.presence_penalty, float, ERRORS.invalid_presence_penalty_type, 0.0,
             ERRORS.invalid_presence_penalty, -2.0, 2.0)
    _bounded(request.frequency_penalty, float, ERRORS.invalid_frequency_penalty_type, 0.0,
             ERRORS.invalid_frequency_penalty, -2.0, 2.0)
    optional(request.user, str, ERRORS.invalid_user_type, None)
    model, adapter = served_model(request.model, engine)
    salt = cache_salt(request.cache_salt)

    check_count(len(prompts), settings.max_items, "prompt")
    texts = list(prompts) if isinstance(prompts[0], str) else None
    sequences = [_tokens(i, prompt, engine) for i, prompt in enumerate(prompts)]
    n_tokens = check_total_tokens(sequences, settings.max_total_tokens, "prompts", "prompt")
    # Without a seed each prompt draws from a fresh generator; with one, the same seed for each prompt.
    seeds = [seed if seed is not None else random.getrandbits(32) for _ in sequences]
    sampling = [Sampling(temperature, s) for s in seeds]
    return CompletionJob(sequences, sampling, texts, max_tokens, echo, logprobs, stop, model, n_tokens, adapter,
                         salt)


def submit_prompts(engine: ScoringEngine, job: CompletionJob, deadline: float,
                   request_id: str) -> concurrent.futures.Future:
    return engine.submit_logprobs(job.sequences, job.sampling, deadline, request_id=request_id, adapter=job.adapter,
                                  cache_salt=job.cache_salt)


def completion_response(job: CompletionJob, result: TokenLogprobsResult,
                        engine: ScoringEngine) -> schemas.CompletionResponse:
    if len(result.sequences) != len(job.sequences):
        raise ValueError(f"engine returned {len(result.sequences)} sequences, expected {len(job.sequences)}")
    choices = [_choice(i, job, sequence, found, engine)
               for i, (sequence, found) in enumerate(zip(job.sequences, result.sequences))]
    completion_tokens = job.max_tokens * len(job.sequences)
    return schemas.CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=job.model, choices=choices,
        usage=schemas.Usage(prompt_tokens=job.n_tokens, completion_tokens=completion_tokens,
                            total_tokens=job.n_tokens + completion_tokens,
                            prompt_tokens_details=cached(result)))


COMPLETIONS = Scoring(schemas.COMPLETION_REQUEST_DECODER, validate_completion_request, submit_prompts,
                      completion_response)


def _choice(index: int, job: CompletionJob, prompt: list[int], found: TokenLogprobs,
            engine: ScoringEngine) -> schemas.CompletionChoice:
    completion, finish_reason = "", "length"
    if job.max_tokens:
        completion, = engine.detokenize([found.next_id])
        for stop in job.stop:
            if stop in completion:
                completion, finish_reason = completion[: completion.index(stop)], "stop"
    if job.echo:
        prompt_text = job.texts[index] if job.texts is not None else "".join(engine.detokenize(prompt))
        text = prompt_text + completion
    else:
        text = completion
    logprobs = None if job.logprobs is None else _logprobs(job, prompt, found, engine)
    return schemas.CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)


def _logprobs(job: CompletionJob, prompt: list[int], found: TokenLogprobs,
              engine: ScoringEngine) -> schemas.CompletionLogprobs:
    """Per returned token: itself, its log-probability, the top alternatives where it was predicted."""
    positions: list[tuple[int, float | None, int | None]] = []  # (token, log-prob, position that predicted it)
    if job.echo:
        positions.append((prompt[0], None, None))  # nothing predicts the first token
        positions += [(token, float(found.next_logprobs[t]), t) for t, token in enumerate(prompt[1:])]
    if job.max_tokens:
        positions.append((found.next_id, found.next_logprob, len(prompt) - 1))
    wanted = [token for token, _, _ in positions]
    for _, _, at in positions:
        if at is not None:
            wanted += found.top_ids[at, : job.logprobs].tolist()
    strings = dict(zip(wanted, engine.detokenize(wanted)))
    tokens, top, offsets, offset = [], [], [], 0
    for token, token_logprob, at in positions:
        tokens.append(strings[token])
        offsets.append(offset)
        offset += len(strings[token])
        if at is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for other, logprob in zip(found.top_ids[at, : job.logprobs].tolist(),
                                  found.top_logprobs[at, : job.logprobs].tolist()):
            alternatives.setdefault(strings[other], logprob)
        alternatives.setdefault(strings[token], token_logprob)  # the token itself, as vLLM does
        top.append(alternatives)
    return schemas.CompletionLogprobs(tokens=tokens, token_logprobs=[lp for _, lp, _ in positions],
                                      top_logprobs=top, text_offset=offsets)


# ---- fields ---------------------------------------------------------------------------------------------

def _max_tokens(raw: msgspec.Raw) -> int:
    if not is_given(raw):
        raise ERRORS.max_tokens_absent()
    value = optional(raw, int, ERRORS.invalid_max_tokens_type, None)
    if value < 0:
        raise ERRORS.invalid_max_tokens(value=value)
    if value > 1:
        raise ERRORS.generation_not_supported(value=value)
    return value


def _bounded(raw: msgspec.Raw, type_: type, wrong_type: ErrorSpec, default, out_of_range: ErrorSpec, low, high):
    """An optional number within [low, high] (its messages: handler.errors' BETWEEN)."""
    value = optional(raw, type_, wrong_type, default)
    if value is not None and not low <= value <= high:
        raise out_of_range(low=low, high=high, value=value)
    return value


def _only(raw: msgspec.Raw, type_: type, wrong_type: ErrorSpec, allowed, other: ErrorSpec) -> None:
    """A field accepted for its one supported value (its message says why that one)."""
    value = optional(raw, type_, wrong_type, allowed)
    if value != allowed:
        raise other(allowed=allowed, value=value)


def _stop(raw: msgspec.Raw) -> tuple[str, ...]:
    value = optional(raw, str | list[str], ERRORS.invalid_stop_type, (), "a string or a list of strings")
    stops = (value,) if isinstance(value, str) else tuple(value)
    check_count(len(stops), MAX_STOP, "stop", ERRORS.invalid_stop)
    return tuple(s for s in stops if s)


def _tokens(index: int, prompt: str | list[int], engine: ScoringEngine) -> list[int]:
    """A text prompt tokenized with the tokenizer's default special tokens; token IDs as given."""
    sequence = list(engine.tokenize(prompt)) if isinstance(prompt, str) else prompt
    check_sequence(sequence, f"prompt[{index}]", "the prompt", "prompt", engine)
    return sequence
