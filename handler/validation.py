"""Request validation: RFC-006's table in its order, then DESIGN.md's additions.

Order for /v1/score: query (missing, type, empty, token range), items (missing, type, empty, mixed modes,
token range), label_token_ids (missing, type, empty, non-integer, negative, beyond vocab), apply_softmax,
item_first, model; then too_many_items, too_many_labels, and after tokenization empty_sequence,
context_length_exceeded, too_many_tokens. A JSON null counts as the field being absent.
Type checks are msgspec's strict ones: `true`/`1`/`"true"` are not interchangeable, `2.5`/`"3"` are not IDs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from runtime.interface import ScoringEngine
from handler.errors import ApiError
from handler.schemas import ScoreRequest, TokenizeRequest
from runtime.settings import Settings

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SHOWN_VALUES = 10  # negative IDs listed in a message
_SHOWN_CHARS = 200  # of a client string echoed in a message

_NULL = msgspec.Raw(b"null")
_INVALID = object()

_TEXT_OR_TOKENS = msgspec.json.Decoder(str | list[int])
_TEXTS = msgspec.json.Decoder(list[str])
_TOKEN_LISTS = msgspec.json.Decoder(list[list[int]])
_INTS = msgspec.json.Decoder(list[int])
_ANY_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_BOOL = msgspec.json.Decoder(bool)
_STR = msgspec.json.Decoder(str)


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    """A validated /v1/score request, ready for the engine."""
    sequences: list[list[int]]  # one full sequence per item, every one non-empty and within the length limit
    label_ids: list[int]
    apply_softmax: bool
    model: str
    n_tokens: int  # sum of the sequence lengths (usage.prompt_tokens)


def decode_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body as the decoder's struct; invalid_json / invalid_body_type for anything that is not a JSON object."""
    if not body.strip():
        raise ApiError("invalid_json", "The request body is empty; expected a JSON object.")
    try:
        # msgspec leaves the strings inside Raw fields unchecked, so check the encoding of the whole body once.
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError("invalid_json", f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.") from None
    try:
        return decoder.decode(body)
    except msgspec.ValidationError:  # well-formed JSON, but not an object (ValidationError subclasses DecodeError)
        raise ApiError("invalid_body_type", "The request body must be a JSON object.") from None
    except msgspec.DecodeError as exc:
        raise ApiError("invalid_json", f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec recurses per nesting level
        raise ApiError("invalid_json", "The request body is not valid JSON: it is nested too deeply.") from None


def validate_score_request(request: ScoreRequest, engine: ScoringEngine, settings: Settings) -> ScoreJob:
    vocab_size = engine.vocab_size
    query = _query(request.query, vocab_size)
    items = _items(request.items, isinstance(query, str), vocab_size)
    label_ids = _labels(request.label_token_ids, vocab_size)
    apply_softmax = _flag(request.apply_softmax, "apply_softmax", "invalid_apply_softmax_type")
    item_first = _flag(request.item_first, "item_first", "invalid_item_first_type")
    model = _model(request.model, engine.model_id)

    if len(items) > settings.max_items:
        raise ApiError("too_many_items",
                       f"items has {len(items)} entries, more than the limit of {settings.max_items}.", "items")
    if len(label_ids) > settings.max_labels:
        raise ApiError("too_many_labels", f"label_token_ids has {len(label_ids)} entries, "
                       f"more than the limit of {settings.max_labels}.", "label_token_ids")

    sequences = _sequences(query, items, item_first, engine)
    n_tokens = sum(map(len, sequences))
    if n_tokens > settings.max_total_tokens:
        raise ApiError("too_many_tokens", f"The request's sequences have {n_tokens} tokens in total, "
                       f"more than the limit of {settings.max_total_tokens}.", "items")
    return ScoreJob(sequences, label_ids, apply_softmax, model, n_tokens)


def validate_tokenize_request(request: TokenizeRequest) -> tuple[str, bool]:
    if not _given(request.text):
        raise ApiError("missing_text", "text is required", "text")
    text = _decode(_STR, request.text, "text")
    if text is _INVALID:
        raise ApiError("invalid_text_type", "text must be a string", "text")
    add_special_tokens = _flag(request.add_special_tokens, "add_special_tokens", "invalid_add_special_tokens_type")
    return text, add_special_tokens


def _given(raw: msgspec.Raw) -> bool:
    return raw is not msgspec.UNSET and raw != _NULL


def _decode(decoder: msgspec.json.Decoder, raw: msgspec.Raw, param: str) -> Any:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:  # wrong type, or a number beyond float range (1e400)
        return _INVALID
    except msgspec.DecodeError as exc:  # e.g. a lone surrogate escape ("\ud800"), which only a typed decode sees
        raise ApiError("invalid_json", f"{param} is not valid JSON: {exc}", param) from None


def _fits_int64(ids: list[int]) -> bool:
    # msgspec decodes integers of any size; beyond int64 no engine or NumPy array can hold them.
    return not ids or (min(ids) >= INT64_MIN and max(ids) <= INT64_MAX)


def _check_token_range(ids: list[int], param: str, vocab_size: int) -> None:
    if min(ids) < 0:
        negatives = [i for i in ids if i < 0][:_SHOWN_VALUES]
        raise ApiError("negative_token_id", f"{param} cannot contain negative values. Got: {negatives}", param)
    if max(ids) >= vocab_size:
        too_big = next(i for i in ids if i >= vocab_size)
        raise ApiError("token_id_exceeds_vocab", f"{param} contains token ID {too_big} which exceeds vocabulary "
                       f"size {vocab_size} (valid IDs are 0 to {vocab_size - 1})", param)


def _query(raw: msgspec.Raw, vocab_size: int) -> str | list[int]:
    if not _given(raw):
        raise ApiError("missing_query", "query is required", "query")
    query = _decode(_TEXT_OR_TOKENS, raw, "query")
    if query is _INVALID or (isinstance(query, list) and not _fits_int64(query)):
        raise ApiError("invalid_query_type", "query must be a string or list of integers", "query")
    if len(query) == 0:  # "" and [] alike: there is no context to score
        raise ApiError("empty_query", "query cannot be empty", "query")
    if isinstance(query, list):
        _check_token_range(query, "query", vocab_size)
    return query


def _items(raw: msgspec.Raw, query_is_text: bool, vocab_size: int) -> list[str] | list[list[int]]:
    if not _given(raw):
        raise ApiError("missing_items", "items is required", "items")
    items = _decode(_TEXTS, raw, "items")
    items_are_text = items is not _INVALID
    if not items_are_text:
        items = _decode(_TOKEN_LISTS, raw, "items")
    if items is _INVALID or (not items_are_text and not all(map(_fits_int64, items))):
        raise ApiError("invalid_items_type", "items must be a list of strings or list of token ID lists", "items")
    if not items:
        raise ApiError("empty_items", "items cannot be empty. At least one item is required.", "items")
    if items_are_text != query_is_text:
        raise ApiError("mixed_input_types", "query and items must both be text (str) or both be tokens (list[int]). "
                       f"Got query type: {_mode(query_is_text)}, items[0] type: {_mode(items_are_text)}", "items")
    if not items_are_text:
        for item in items:
            if item:  # an empty item [] is allowed, like ""
                _check_token_range(item, "items", vocab_size)
    return items


def _mode(is_text: bool) -> str:
    return "str" if is_text else "list[int]"


def _labels(raw: msgspec.Raw, vocab_size: int) -> list[int]:
    if not _given(raw):
        raise ApiError("missing_label_token_ids", "label_token_ids is required", "label_token_ids")
    labels = _decode(_INTS, raw, "label_token_ids")
    if labels is _INVALID:
        if _decode(_ANY_LIST, raw, "label_token_ids") is _INVALID:
            raise ApiError("invalid_label_token_ids_type", "label_token_ids must be a list of integers",
                           "label_token_ids")
        raise ApiError("invalid_token_id_type", "label_token_ids must contain only integers", "label_token_ids")
    if not labels:
        raise ApiError("empty_label_token_ids",
                       "label_token_ids cannot be empty. At least one label token ID is required.", "label_token_ids")
    if not _fits_int64(labels):
        raise ApiError("invalid_token_id_type",
                       "label_token_ids must contain only integers (within the signed 64-bit range)", "label_token_ids")
    _check_token_range(labels, "label_token_ids", vocab_size)
    return labels


def _flag(raw: msgspec.Raw, name: str, code: str) -> bool:
    if not _given(raw):
        return False
    value = _decode(_BOOL, raw, name)
    if value is _INVALID:
        raise ApiError(code, f"{name} must be a boolean", name)
    return value


def _model(raw: msgspec.Raw, served_model: str) -> str:
    if not _given(raw):
        return served_model
    model = _decode(_STR, raw, "model")
    if model is _INVALID:
        raise ApiError("invalid_model_type", "model must be a string", "model")
    if model != served_model:
        shown = model if len(model) <= _SHOWN_CHARS else model[:_SHOWN_CHARS] + "..."
        raise ApiError("model_not_found", f"Model '{shown}' not found. Available models: ['{served_model}']", "model")
    return model


def _sequences(query: str | list[int], items: list[str] | list[list[int]], item_first: bool,
               engine: ScoringEngine) -> list[list[int]]:
    if isinstance(query, str):
        # Text is joined before tokenizing (a token may span the boundary), with the default special tokens.
        sequences = [engine.tokenize(item + query if item_first else query + item) for item in items]
    else:
        sequences = [item + query if item_first else query + item for item in items]
    limit = engine.max_sequence_length
    for index, sequence in enumerate(sequences):
        if not sequence:
            raise ApiError("empty_sequence", f"items[{index}]: the sequence to score is empty.", "items")
        if len(sequence) > limit:
            raise ApiError("context_length_exceeded", f"items[{index}]: the sequence has {len(sequence)} tokens, "
                           f"more than the maximum sequence length of {limit} tokens.", "items")
    return sequences
