"""POST /v1/score (RFC-000, RFC-006): validation in RFC-006's order, and the response.

Order: query (missing, type, empty, token range), items (missing, type, empty, mixed modes, token range),
label_token_ids (missing, type, empty, non-integer, negative, beyond vocab), apply_softmax, item_first, model;
then too_many_items, too_many_labels, and after tokenization empty_sequence, context_length_exceeded,
too_many_tokens. A JSON null counts as the field being absent.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import msgspec
import numpy as np

from handler import schemas
from handler.errors import ApiError
from handler.http import Scoring, submit_labels
from handler.validation import (INVALID, check_count, check_sequence, check_token_range, check_total_tokens,
                                decode_field, fits_int64, is_given, optional, require_language_model, required,
                                served_model)
from runtime.interface import ScoreResult, ScoringEngine
from runtime.probability import softmax
from runtime.settings import Settings


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    """A validated /v1/score request, ready for the engine."""
    sequences: list[list[int]]  # one full sequence per item, every one non-empty and within the length limit
    label_ids: list[int]
    apply_softmax: bool
    model: str
    n_tokens: int  # sum of the sequence lengths (usage.prompt_tokens)
    adapter: str | None = None  # the LoRA adapter `model` names (None: the base model)


def validate_score_request(request: schemas.ScoreRequest, engine: ScoringEngine, settings: Settings) -> ScoreJob:
    require_language_model(engine)
    vocab_size = engine.vocab_size
    query = _query(request.query, vocab_size)
    items = _items(request.items, isinstance(query, str), vocab_size)
    label_ids = _labels(request.label_token_ids, vocab_size)
    apply_softmax = optional(request.apply_softmax, bool, "apply_softmax", False)
    item_first = optional(request.item_first, bool, "item_first", False)
    model, adapter = served_model(request.model, engine)

    check_count(len(items), settings.max_items, "items")
    check_count(len(label_ids), settings.max_labels, "label_token_ids", "too_many_labels")
    sequences = _sequences(query, items, item_first, engine)
    n_tokens = check_total_tokens(sequences, settings.max_total_tokens, "sequences", "items")
    return ScoreJob(sequences, label_ids, apply_softmax, model, n_tokens, adapter)


def score_response(job: ScoreJob, result: ScoreResult, engine: ScoringEngine) -> schemas.ScoreResponse:
    logprobs = np.asarray(result.logprobs)  # [items, labels]
    expected = (len(job.sequences), len(job.label_ids))
    if logprobs.shape != expected:
        raise ValueError(f"engine returned logprobs of shape {logprobs.shape}, expected {expected}")
    # softmax over the requested labels only, per item, in float64 on the host (RFC-000, ADR-001)
    scores = softmax(logprobs, axis=1) if job.apply_softmax else logprobs
    return schemas.ScoreResponse(
        id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=job.model, scores=scores.tolist(),
        usage=schemas.Usage(prompt_tokens=job.n_tokens, total_tokens=job.n_tokens))


SCORE = Scoring(schemas.SCORE_REQUEST_DECODER, validate_score_request, submit_labels, score_response)


# ---- fields ---------------------------------------------------------------------------------------------

_QUERY_KIND = "a string or list of integers"


def _query(raw: msgspec.Raw, vocab_size: int) -> str | list[int]:
    query = required(raw, str | list[int], "query", _QUERY_KIND)
    if isinstance(query, list) and not fits_int64(query):
        raise ApiError("invalid_query_type", f"query must be {_QUERY_KIND}", "query")
    if len(query) == 0:  # "" and [] alike: there is no context to score
        raise ApiError("empty_query", "query cannot be empty", "query")
    if isinstance(query, list):
        check_token_range(query, "query", vocab_size)
    return query


def _items(raw: msgspec.Raw, query_is_text: bool, vocab_size: int) -> list[str] | list[list[int]]:
    if not is_given(raw):
        raise ApiError("missing_items", "items is required", "items")
    items = decode_field(raw, list[str], "items")
    items_are_text = items is not INVALID
    if not items_are_text:
        items = decode_field(raw, list[list[int]], "items")
    if items is INVALID or (not items_are_text and not all(map(fits_int64, items))):
        raise ApiError("invalid_items_type", "items must be a list of strings or list of token ID lists", "items")
    if not items:
        raise ApiError("empty_items", "items cannot be empty. At least one item is required.", "items")
    if items_are_text != query_is_text:
        raise ApiError("mixed_input_types", "query and items must both be text (str) or both be tokens (list[int]). "
                       f"Got query type: {_mode(query_is_text)}, items[0] type: {_mode(items_are_text)}", "items")
    if not items_are_text:
        for item in items:
            if item:  # an empty item [] is allowed, like ""
                check_token_range(item, "items", vocab_size)
    return items


def _mode(is_text: bool) -> str:
    return "str" if is_text else "list[int]"


def _labels(raw: msgspec.Raw, vocab_size: int) -> list[int]:
    if not is_given(raw):
        raise ApiError("missing_label_token_ids", "label_token_ids is required", "label_token_ids")
    labels = decode_field(raw, list[int], "label_token_ids")
    if labels is INVALID:
        if decode_field(raw, list[msgspec.Raw], "label_token_ids") is INVALID:
            raise ApiError("invalid_label_token_ids_type", "label_token_ids must be a list of integers",
                           "label_token_ids")
        raise ApiError("invalid_token_id_type", "label_token_ids must contain only integers", "label_token_ids")
    if not labels:
        raise ApiError("empty_label_token_ids",
                       "label_token_ids cannot be empty. At least one label token ID is required.", "label_token_ids")
    if not fits_int64(labels):
        raise ApiError("invalid_token_id_type",
                       "label_token_ids must contain only integers (within the signed 64-bit range)", "label_token_ids")
    check_token_range(labels, "label_token_ids", vocab_size)
    return labels


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
