"""POST /v1/score (RFC-000, RFC-006): validation in RFC-006's order, and the response.

Order: query (missing, type, empty, token range), items (missing, type, empty, mixed modes, token range),
label_token_ids (missing, type, empty, non-integer, a label of no token or too many, negative, beyond vocab) or
labels (both: conflicting; type, empty, text mode only), apply_softmax, item_first, label_normalization,
return_token_logprobs, model, cache_salt; then too_many_items, too_many_labels, labels' tokenization (empty, too
long), and after the items' tokenization empty_sequence, context_length_exceeded, too_many_tokens. A JSON null
counts as the field being absent.

A label is a token ID (today's one-token labels: their next-token log-probability) or several tokens (a list of IDs,
or `labels` as text): its log-probability is the sum of its tokens', each after the item and the label's tokens
before it (the engine scores the item once and each label's tokens as rows after it).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import msgspec
import numpy as np

from handler import schemas
from handler.errors import ERRORS
from handler.http import Scoring, cached, label_values, submit_labels
from handler.validation import (INVALID, cache_salt, check_count, check_sequence, check_token_range, check_total_tokens,
                                decode_field, fits_int64, is_given, optional, require_language_model, required,
                                served_model)
from runtime.interface import ScoreResult, ScoringEngine
from runtime.probability import softmax
from runtime.settings import Settings


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    """A validated /v1/score request, ready for the engine."""
    sequences: list[list[int]]  # one full sequence per item, every one non-empty and within the length limit
    label_ids: list[int] | list[int | list[int]]  # a token ID, or a label's token IDs
    apply_softmax: bool
    model: str
    n_tokens: int  # sum of the sequence lengths (usage.prompt_tokens)
    adapter: str | None = None  # the LoRA adapter `model` names (None: the base model)
    normalization: str = "sum"  # sum | mean
    token_logprobs: bool = False  # return each label's tokens' log-probabilities
    cache_salt: str | None = None  # the prefix cache's (runtime.requests.prefix_cache)


def validate_score_request(request: schemas.ScoreRequest, engine: ScoringEngine, settings: Settings) -> ScoreJob:
    require_language_model(engine)
    vocab_size = engine.vocab_size
    query = _query(request.query, vocab_size)
    items = _items(request.items, isinstance(query, str), vocab_size)
    label_ids, texts = _labels(request.label_token_ids, request.labels, isinstance(query, str), vocab_size,
                               settings.max_label_tokens)
    apply_softmax = optional(request.apply_softmax, bool, ERRORS.invalid_apply_softmax_type, False)
    item_first = optional(request.item_first, bool, ERRORS.invalid_item_first_type, False)
    normalization = optional(request.label_normalization, str, ERRORS.invalid_label_normalization_type, "sum")
    if normalization not in NORMALIZATIONS:
        raise ERRORS.invalid_label_normalization(choices=list(NORMALIZATIONS), value=normalization)
    token_logprobs = optional(request.return_token_logprobs, bool, ERRORS.invalid_return_token_logprobs_type, False)
    model, adapter = served_model(request.model, engine)
    salt = cache_salt(request.cache_salt)

    check_count(len(items), settings.max_items, "items")
    # The one check of a request's label count: SCOREFN_MAX_LABELS is the largest label bucket the runtime compiles
    # (declared classifiers' and rerankers' labels are checked against it at start-up).
    check_count(len(label_ids if texts is None else texts), settings.max_labels,
                "label_token_ids" if texts is None else "labels", ERRORS.too_many_labels)
    if texts is not None:
        label_ids = [_text_label(text, index, engine, settings.max_label_tokens) for index, text in enumerate(texts)]
    sequences = _sequences(query, items, item_first, engine)
    n_tokens = check_total_tokens(sequences, settings.max_total_tokens, "sequences", "items")
    return ScoreJob(sequences, label_ids, apply_softmax, model, n_tokens, adapter, normalization, token_logprobs,
                    salt)


NORMALIZATIONS = ("sum", "mean")


def score_response(job: ScoreJob, result: ScoreResult, engine: ScoringEngine) -> schemas.ScoreResponse:
    logprobs = label_values(job, result).astype(np.float64)  # [items, labels]
    if job.normalization == "mean":  # per token: a label's log-probability over its token count
        logprobs = logprobs / np.array([1 if isinstance(label, int) else len(label) for label in job.label_ids])
    # softmax over the requested labels only, per item, in float64 on the host (RFC-000, ADR-001)
    scores = softmax(logprobs, axis=1) if job.apply_softmax else logprobs
    tokens = msgspec.UNSET
    if job.token_logprobs:  # one-token labels: their one log-probability
        per_token = result.token_logprobs or [[np.asarray([value]) for value in row] for row in result.logprobs]
        tokens = [[np.asarray(label, np.float64).tolist() for label in row] for row in per_token]
    return schemas.ScoreResponse(
        id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=job.model, scores=scores.tolist(),
        usage=schemas.Usage(prompt_tokens=job.n_tokens, total_tokens=job.n_tokens,
                            prompt_tokens_details=cached(result)),
        token_logprobs=tokens)


SCORE = Scoring(schemas.SCORE_REQUEST_DECODER, validate_score_request, submit_labels, score_response)


# ---- fields ---------------------------------------------------------------------------------------------

_QUERY_KIND = "a string or list of integers"


def _query(raw: msgspec.Raw, vocab_size: int) -> str | list[int]:
    query = required(raw, str | list[int], ERRORS.missing_query, ERRORS.invalid_query_type, _QUERY_KIND)
    if isinstance(query, list) and not fits_int64(query):
        raise ERRORS.invalid_query_type(kind=_QUERY_KIND)
    if len(query) == 0:  # "" and [] alike: there is no context to score
        raise ERRORS.empty_query()
    if isinstance(query, list):
        check_token_range(query, "query", vocab_size)
    return query


def _items(raw: msgspec.Raw, query_is_text: bool, vocab_size: int) -> list[str] | list[list[int]]:
    if not is_given(raw):
        raise ERRORS.missing_items()
    items = decode_field(raw, list[str], "items")
    items_are_text = items is not INVALID
    if not items_are_text:
        items = decode_field(raw, list[list[int]], "items")
    if items is INVALID or (not items_are_text and not all(map(fits_int64, items))):
        raise ERRORS.invalid_items_type()
    if not items:
        raise ERRORS.empty_items()
    if items_are_text != query_is_text:
        raise ERRORS.mixed_input_types(query=_mode(query_is_text), items=_mode(items_are_text))
    if not items_are_text:
        for item in items:
            if item:  # an empty item [] is allowed, like ""
                check_token_range(item, "items", vocab_size)
    return items


def _mode(is_text: bool) -> str:
    return "str" if is_text else "list[int]"


def _labels(raw: msgspec.Raw, texts_raw: msgspec.Raw, query_is_text: bool, vocab_size: int,
            max_tokens: int) -> tuple[list[int | list[int]], list[str] | None]:
    """label_token_ids (token IDs, or lists of them), or `labels` (text, tokenized later: returned as texts)."""
    if texts_raw is not msgspec.UNSET:  # `labels` sent: null is not a list of strings (the schema's oneOf)
        if raw is not msgspec.UNSET:
            raise ERRORS.conflicting_labels()
        texts = decode_field(texts_raw, list[str], "labels") if is_given(texts_raw) else INVALID
        if texts is INVALID:
            raise ERRORS.invalid_labels_type()
        if not texts:
            raise ERRORS.empty_labels()
        if not query_is_text:
            raise ERRORS.labels_need_text()
        return [], texts
    if not is_given(raw):
        raise ERRORS.missing_label_token_ids()
    labels = decode_field(raw, list[int | list[int]], "label_token_ids")
    if labels is INVALID:
        if decode_field(raw, list[msgspec.Raw], "label_token_ids") is INVALID:
            raise ERRORS.invalid_label_token_ids_type()
        raise ERRORS.invalid_token_id_type()
    if not labels:
        raise ERRORS.empty_label_token_ids()
    flat = [token for label in labels for token in ([label] if isinstance(label, int) else label)]
    if not fits_int64(flat):
        raise ERRORS.label_id_beyond_int64()
    for index, label in enumerate(labels):
        if isinstance(label, list):
            _check_label_length(len(label), f"label_token_ids[{index}]", max_tokens, "label_token_ids")
    check_token_range(flat, "label_token_ids", vocab_size)
    return [_one_token_as_id(label) for label in labels], None


def _one_token_as_id(label: int | list[int]) -> int | list[int]:
    """A label of one token as its ID: the one-token path (every label of a request an ID: today's), same bits."""
    return label[0] if isinstance(label, list) and len(label) == 1 else label


def _check_label_length(tokens: int, label: str, max_tokens: int, param: str) -> None:
    if tokens == 0:
        raise ERRORS.empty_label(param, label=label)
    if tokens > max_tokens:
        raise ERRORS.label_too_long(param, label=label, count=tokens, limit=max_tokens)


def _text_label(text: str, index: int, engine: ScoringEngine, max_tokens: int) -> int | list[int]:
    """A label given as text, tokenized as a continuation: without the special tokens a sequence starts with."""
    tokens = engine.tokenize(text, add_special_tokens=False)
    _check_label_length(len(tokens), f"labels[{index}] ({text!r})", max_tokens, "labels")
    return _one_token_as_id(tokens)


def _sequences(query: str | list[int], items: list[str] | list[list[int]], item_first: bool,
               engine: ScoringEngine) -> list[list[int]]:
    if isinstance(query, str):
        # Text is joined before tokenizing (a token may span the boundary), with the default special tokens.
        sequences = [engine.tokenize(item + query if item_first else query + item) for item in items]
    else:
        sequences = [item + query if item_first else query + item for item in items]
    for index, sequence in enumerate(sequences):
        check_sequence(sequence, f"items[{index}]", "the sequence", "items", engine)
    return sequences
