"""POST /v1/classify (vLLM's classification API): request validation, and the response from the engine's scores.

The engine scores classification like /v1/score: one prefill per input, read at its last token. For a
sequence-classification checkpoint the "labels" are its score head's rows (raw logits); for a prompt-verbalizer
classifier they are the verbalizer tokens (log-probabilities, i.e. logits minus a per-input constant, so their
softmax is the softmax of the verbalizer logits).

Order: input (missing, type, empty, token range), truncate_prompt_tokens, use_activation, user, rid, priority,
model; then too_many_items, and after tokenization empty_sequence, context_length_exceeded, too_many_tokens.
A JSON null counts as the field being absent.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import msgspec
import numpy as np
import scipy.special

from handler import schemas
from runtime.interface import ScoreResult, ScoringEngine
from handler.errors import ApiError
from handler.validation import _INVALID, _SHOWN_CHARS, _check_token_range, _decode, _fits_int64, _given
from runtime.classifiers import Classifier
from runtime.settings import Settings

_TEXT = msgspec.json.Decoder(str)
_TEXTS = msgspec.json.Decoder(list[str])
_TOKENS = msgspec.json.Decoder(list[int])
_TOKEN_LISTS = msgspec.json.Decoder(list[list[int]])
_INT = msgspec.json.Decoder(int)
_BOOL = msgspec.json.Decoder(bool)
# (decoder, whether the value is a list of inputs) in the order tried: `[]` reads as an empty list of texts.
_INPUT_FORMS = ((_TEXT, False), (_TEXTS, True), (_TOKENS, False), (_TOKEN_LISTS, True))


@dataclasses.dataclass(frozen=True)
class ClassifyJob:
    """A validated /v1/classify request, ready for the engine."""
    sequences: list[list[int]]  # one prompt per input, in input order, each non-empty and within the length limit
    label_ids: list[int]  # the classifier's
    classifier: Classifier
    use_activation: bool
    model: str  # the classifier's id, answered as `model`
    n_tokens: int  # usage.prompt_tokens


def require_language_model(engine: ScoringEngine) -> None:
    """/v1/score needs a language-model head; a sequence-classification checkpoint has none."""
    if engine.task != "causal_lm":
        raise ApiError("model_not_supported", f"The served model '{engine.model_id}' is a sequence-classification "
                       "model: it has no language-model head to score label tokens with. Use POST /v1/classify.")


def validate_classify_request(request: schemas.ClassifyRequest, engine: ScoringEngine,
                              settings: Settings) -> ClassifyJob:
    inputs = _inputs(request.input, engine.vocab_size)
    keep = _truncation(request.truncate_prompt_tokens, engine.max_sequence_length)
    use_activation = _typed(request.use_activation, _BOOL, "use_activation", "a boolean", True)
    _typed(request.user, _TEXT, "user", "a string", None)
    _typed(request.rid, _TEXT, "rid", "a string", None)
    _typed(request.priority, _INT, "priority", "an integer", None)
    classifier = _classifier(request.model, engine)

    if len(inputs) > settings.max_items:
        raise ApiError("too_many_items",
                       f"input has {len(inputs)} entries, more than the limit of {settings.max_items}.", "input")
    sequences = [_prompt(index, value, classifier, engine, keep) for index, value in enumerate(inputs)]
    n_tokens = sum(map(len, sequences))
    if n_tokens > settings.max_total_tokens:
        raise ApiError("too_many_tokens", f"The request's prompts have {n_tokens} tokens in total, "
                       f"more than the limit of {settings.max_total_tokens}.", "input")
    return ClassifyJob(sequences, list(classifier.label_ids), classifier, use_activation, classifier.name, n_tokens)


def classify_response(job: ClassifyJob, result: ScoreResult) -> schemas.ClassifyResponse:
    values = np.asarray(result.logprobs)  # [inputs, labels]: raw logits, or verbalizer log-probabilities
    expected = (len(job.sequences), len(job.label_ids))
    if values.shape != expected:
        raise ValueError(f"engine returned scores of shape {values.shape}, expected {expected}")
    probs = activate(values, job.classifier.activation) if job.use_activation else values
    labels = job.classifier.labels
    best = values.argmax(axis=1)  # the activations are monotonic: the same label wins either way
    data = [schemas.ClassifyData(index=i, label=labels[best[i]], probs=row, num_classes=len(labels))
            for i, row in enumerate(probs.tolist())]
    return schemas.ClassifyResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=job.model,
                                    data=data, usage=schemas.Usage(prompt_tokens=job.n_tokens,
                                                                   total_tokens=job.n_tokens))


def activate(values: np.ndarray, activation: str) -> np.ndarray:
    """Scores to probabilities, per row, in float64 on the host."""
    values = values.astype(np.float64)
    if activation == "sigmoid":
        return scipy.special.expit(values)
    return scipy.special.softmax(values, axis=1)


def model_cards(engine: ScoringEngine, created: int) -> list[schemas.ModelCard]:
    """GET /v1/models: the served model, then each classifier with its labels."""
    if engine.task == "sequence_classification" and engine.classifiers:
        head = engine.classifiers[0]
        return [schemas.ModelCard(id=engine.model_id, created=created, task="classify", labels=list(head.labels))]
    return [schemas.ModelCard(id=engine.model_id, created=created)] + [
        schemas.ModelCard(id=c.name, created=created, parent=engine.model_id, task="classify", labels=list(c.labels))
        for c in engine.classifiers]


# ---- fields ---------------------------------------------------------------------------------------------

def _inputs(raw: msgspec.Raw, vocab_size: int) -> list[str] | list[list[int]]:
    if not _given(raw):
        raise ApiError("missing_input", "input is required", "input")
    for decoder, is_list in _INPUT_FORMS:
        value = _decode(decoder, raw, "input")
        if value is not _INVALID:
            break
    else:
        raise ApiError("invalid_input_type", "input must be a string, a list of strings, a list of token IDs "
                       "or a list of token-ID lists", "input")
    inputs = value if is_list else [value]
    tokens = bool(inputs) and isinstance(inputs[0], list)
    if tokens and not all(map(_fits_int64, inputs)):
        raise ApiError("invalid_input_type", "input token IDs must be integers within the signed 64-bit range",
                       "input")
    if not inputs:
        raise ApiError("empty_input", "input cannot be empty. At least one input is required.", "input")
    for index, item in enumerate(inputs):
        if not item or (isinstance(item, str) and not item.strip()):
            where = f"input[{index}]" if is_list else "input"
            raise ApiError("empty_input", f"{where} is empty{' or whitespace only' if not tokens else ''}; "
                           "there is nothing to classify.", "input")
    if tokens:
        for item in inputs:
            _check_token_range(item, "input", vocab_size)
    return inputs


def _truncation(raw: msgspec.Raw, max_length: int) -> int | None:
    """How many trailing tokens of each prompt to keep; None: never truncate."""
    if not _given(raw):
        return None
    value = _decode(_INT, raw, "truncate_prompt_tokens")
    if value is _INVALID:
        raise ApiError("invalid_truncate_prompt_tokens_type", "truncate_prompt_tokens must be an integer",
                       "truncate_prompt_tokens")
    if value == -1:
        return max_length
    if not 1 <= value <= max_length:
        raise ApiError("invalid_truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 (the maximum sequence "
                       f"length, {max_length}) or between 1 and {max_length}; got {value}.", "truncate_prompt_tokens")
    return value


def _typed(raw: msgspec.Raw, decoder: msgspec.json.Decoder, name: str, kind: str, default: Any) -> Any:
    if not _given(raw):
        return default
    value = _decode(decoder, raw, name)
    if value is _INVALID:
        raise ApiError(f"invalid_{name}_type", f"{name} must be {kind}", name)
    return value


def _classifier(raw: msgspec.Raw, engine: ScoringEngine) -> Classifier:
    name = None
    if _given(raw):
        name = _decode(_TEXT, raw, "model")
        if name is _INVALID:
            raise ApiError("invalid_model_type", "model must be a string", "model")
    classifiers = engine.classifiers
    if not classifiers:
        raise ApiError("model_not_supported", f"The served model '{engine.model_id}' has no classifier: declare a "
                       "prompt-verbalizer classifier in SCOREFN_CLASSIFIERS (see the README).")
    if name is None or (name == engine.model_id and name not in (c.name for c in classifiers)):
        return classifiers[0]  # the served model's own id selects its first classifier
    for classifier in classifiers:
        if classifier.name == name:
            return classifier
    shown = name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."
    available = [c.name for c in classifiers]
    raise ApiError("model_not_found", f"Model '{shown}' not found. Available classifiers: {available}", "model")


def _prompt(index: int, value: str | list[int], classifier: Classifier, engine: ScoringEngine,
            keep: int | None) -> list[int]:
    if isinstance(value, str):
        sequence = list(engine.tokenize(classifier.render(value), add_special_tokens=classifier.add_special_tokens))
    else:
        sequence = classifier.splice(value)
    if keep is not None:
        sequence = sequence[-keep:]  # vLLM's truncate_prompt_tokens: the prompt's last tokens
    limit = engine.max_sequence_length
    if not sequence:
        raise ApiError("empty_sequence", f"input[{index}]: the prompt to classify has no token.", "input")
    if len(sequence) > limit:
        raise ApiError("context_length_exceeded", f"input[{index}]: the prompt has {len(sequence)} tokens, more than "
                       f"the maximum sequence length of {limit} tokens. Set truncate_prompt_tokens to keep only its "
                       "last tokens.", "input")
    return sequence
