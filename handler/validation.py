"""Validation shared by every endpoint: the body, one field of a given type, token IDs, inputs, the size
limits, `model`.

The request structs hold each field as `msgspec.Raw` (handler.schemas says why); `required`, `optional` and
`decode_field` decode one field at the point the endpoint's order reaches it. Type checks are msgspec's strict
ones: `true`/`1`/`"true"` are not interchangeable, `2.5`/`"3"` are not IDs. A JSON null counts as the field being
absent. Each endpoint's own rules are in its module (handler.score, handler.classify, handler.rerank,
handler.completions).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgspec

from handler.errors import ERRORS, ErrorSpec
from handler.schemas import MAX_CACHE_SALT_CHARS, TokenizeRequest
from runtime.interface import ScoringEngine
from runtime.tasks.classifiers import adapter_heads

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INVALID = object()  # decode_field's answer for a value of the wrong type
_SHOWN_VALUES = 10  # negative IDs listed in a message
_SHOWN_CHARS = 200  # of a client string echoed in a message

_NULL = msgspec.Raw(b"null")
# How a type is named in an invalid_<name>_type message ("<name> must be <kind>").
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
# (type, whether the value is a list of inputs) in the order tried: `[]` reads as an empty list of texts.
_INPUT_FORMS = ((str, False), (list[str], True), (list[int], False), (list[list[int]], True))


def decode_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body as the decoder's struct; invalid_json / invalid_body_type for anything that is not a JSON object."""
    if not body.strip():
        raise ERRORS.empty_body()
    try:
        # msgspec leaves the strings inside Raw fields unchecked, so check the encoding of the whole body once.
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ERRORS.body_not_utf8(reason=exc.reason, at=exc.start) from None
    try:
        return decoder.decode(body)
    except msgspec.ValidationError:  # well-formed JSON, but not an object (ValidationError subclasses DecodeError)
        raise ERRORS.invalid_body_type() from None
    except msgspec.DecodeError as exc:
        raise ERRORS.invalid_json(reason=exc) from None
    except RecursionError:  # msgspec recurses per nesting level
        raise ERRORS.body_too_deep() from None


def validate_tokenize_request(request: TokenizeRequest) -> tuple[str, bool]:
    text = required(request.text, str, ERRORS.missing_text, ERRORS.invalid_text_type)
    add_special_tokens = optional(request.add_special_tokens, bool, ERRORS.invalid_add_special_tokens_type, False)
    return text, add_special_tokens


# ---- one field ------------------------------------------------------------------------------------------

def is_given(raw: msgspec.Raw) -> bool:
    """Whether a request field was sent: absent (UNSET) and JSON null both count as not given."""
    return raw is not msgspec.UNSET and raw != _NULL


def decode_field(raw: msgspec.Raw, type_: Any, param: str) -> Any:
    """A given field's JSON as `type_` (msgspec's strict types), or INVALID when it is not one."""
    try:
        return _decoder(type_).decode(raw)
    except msgspec.ValidationError:  # wrong type, or a number beyond float range (1e400)
        return INVALID
    except msgspec.DecodeError as exc:
        # Malformed JSON inside the field that the body's decode let through: a safeguard (msgspec 0.22 already
        # rejects a lone surrogate escape, "\ud800", while it skips over a Raw field).
        raise ERRORS.field_not_json(param, reason=exc) from None


def required(raw: msgspec.Raw, type_: Any, missing: ErrorSpec, wrong_type: ErrorSpec, kind: str | None = None) -> Any:
    """A required field of `type_`: `missing` when absent or null, `wrong_type` (its message's `kind` defaults to the
    type's name for bool, int, float and str) when of another type. The entries name the field (their param)."""
    kind = kind or _KINDS[type_]  # up front: a type with no kind fails on every call, not only on a wrong value
    if not is_given(raw):
        raise missing()
    return _typed(raw, type_, wrong_type, kind)


def optional(raw: msgspec.Raw, type_: Any, wrong_type: ErrorSpec, default: Any, kind: str | None = None) -> Any:
    """An optional field of `type_` (absent or null: `default`), else as `required`'s `wrong_type`."""
    kind = kind or _KINDS[type_]
    if not is_given(raw):
        return default
    return _typed(raw, type_, wrong_type, kind)


def _typed(raw: msgspec.Raw, type_: Any, wrong_type: ErrorSpec, kind: str) -> Any:
    value = decode_field(raw, type_, wrong_type.param)
    if value is INVALID:
        raise wrong_type(kind=kind)
    return value


@functools.cache
def _decoder(type_: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(type_)  # built once per type: msgspec caches type information inside a decoder


# ---- token IDs, inputs, limits --------------------------------------------------------------------------

def fits_int64(ids: list[int]) -> bool:
    """Whether every ID fits in int64: msgspec decodes integers of any size, but no engine or NumPy array holds
    one beyond that."""
    return not ids or (min(ids) >= INT64_MIN and max(ids) <= INT64_MAX)


def check_token_range(ids: list[int], param: str, vocab_size: int) -> None:
    """Non-empty `ids` within [0, vocab_size): negative_token_id, token_id_exceeds_vocab."""
    if min(ids) < 0:
        negatives = [i for i in ids if i < 0][:_SHOWN_VALUES]
        raise ERRORS.negative_token_id(param, values=negatives)
    if max(ids) >= vocab_size:
        too_big = next(i for i in ids if i >= vocab_size)
        raise ERRORS.token_id_exceeds_vocab(param, token=too_big, vocab_size=vocab_size, highest=vocab_size - 1)


def check_count(count: int, limit: int, param: str, too_many: ErrorSpec = ERRORS.too_many_items) -> None:
    """At most `limit` entries in the list field `param`: too_many_items (every scoring endpoint's inputs), or the
    entry given (/v1/score's too_many_labels, /v1/completions' invalid_stop)."""
    if count > limit:
        raise too_many(param, count=count, limit=limit)


def check_total_tokens(sequences: list[list[int]], limit: int, what: str, param: str) -> int:
    """The request's tokens in total (usage.prompt_tokens), at most `limit` (too_many_tokens); `what` names the
    sequences in the message ("prompts", "query-document pairs")."""
    n_tokens = sum(map(len, sequences))
    if n_tokens > limit:
        raise ERRORS.too_many_tokens(param, what=what, count=n_tokens, limit=limit)
    return n_tokens


@dataclasses.dataclass(frozen=True)
class InputsField:
    """What decode_inputs raises for a field of inputs (/v1/classify's `input`, /v1/completions' `prompt`): entries
    of ERRORS that name the field."""
    missing: ErrorSpec
    wrong_type: ErrorSpec
    beyond_int64: ErrorSpec  # token IDs no engine holds
    empty: ErrorSpec  # no input at all
    empty_element: ErrorSpec  # an input with nothing in it


def decode_inputs(raw: msgspec.Raw, field: InputsField, vocab_size: int,
                  blank_ok: bool = False) -> tuple[list[str] | list[list[int]], bool]:
    """A field that is a text, a list of texts, token IDs or a list of token-ID lists: (the inputs as a list, whether
    the field was a list). An empty element is empty too, and so is a whitespace-only text unless `blank_ok`; token
    IDs are checked against the vocabulary."""
    name = field.wrong_type.param
    if not is_given(raw):
        raise field.missing()
    for form, is_list in _INPUT_FORMS:
        value = decode_field(raw, form, name)
        if value is not INVALID:
            break
    else:
        raise field.wrong_type()
    inputs = value if is_list else [value]
    tokens = bool(inputs) and isinstance(inputs[0], list)
    if tokens and not all(map(fits_int64, inputs)):
        raise field.beyond_int64()
    if not inputs:
        raise field.empty()
    for index, item in enumerate(inputs):
        if not item or (isinstance(item, str) and not blank_ok and not item.strip()):
            where = f"{name}[{index}]" if is_list else name
            raise field.empty_element(where=where, blank=" or whitespace only" if not tokens and not blank_ok else "")
    if tokens:
        for item in inputs:
            check_token_range(item, name, vocab_size)
    return inputs, is_list


def cache_salt(raw: msgspec.Raw) -> str | None:
    """`cache_salt` (vLLM's name): absent or null, or a non-empty string of at most MAX_CACHE_SALT_CHARS; requests
    share cached prefixes only with the same salt (runtime.requests.prefix_cache)."""
    salt = optional(raw, str, ERRORS.invalid_cache_salt_type, None)
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ERRORS.invalid_cache_salt(limit=MAX_CACHE_SALT_CHARS, length=f"{len(salt)} characters")
    return salt


def served_model(raw: msgspec.Raw, engine: ScoringEngine) -> tuple[str, str | None]:
    """`model`: absent, null or the served model's id (the base model), or a LoRA adapter's name; anything else is
    model_not_found. Returns (the name answered as `model`, the adapter or None)."""
    model = optional(raw, str, ERRORS.invalid_model_type, None)
    if model is None or model == engine.model_id:
        return engine.model_id, None
    if model in adapter_heads(engine.classifiers):
        raise ERRORS.adapter_classifies(model=model)
    if model in engine.adapters:
        return model, model
    raise ERRORS.model_not_found(model=_shown(model), models=[engine.model_id, *engine.adapters])


def select_named(raw: msgspec.Raw, choices: tuple, engine: ScoringEngine, kind: str,
                 none: ErrorSpec) -> tuple[Any, str | None]:
    """`model` naming one of `choices` (classifiers, rerankers; each has a `.name`), or a LoRA adapter (the first
    choice, run with it): absent, null or the served model's own id select the first. `none`: the error when there is
    no choice (it says how to get one). Returns (the choice, the adapter or None)."""
    name, model_id = optional(raw, str, ERRORS.invalid_model_type, None), engine.model_id
    if not choices:
        raise none(model=model_id)
    if name is None or (name == model_id and name not in (c.name for c in choices)):
        return choices[0], None
    for choice in choices:
        if choice.name == name:
            return choice, None
    if name in engine.adapters:
        if name in adapter_heads(engine.classifiers):
            raise ERRORS.adapter_not_a_choice(model=name, kind=kind)
        return choices[0], name
    adapters = f" and LoRA adapters: {list(engine.adapters)}" if engine.adapters else ""
    raise ERRORS.not_a_choice(model=_shown(name), kind=kind, choices=[c.name for c in choices], adapters=adapters)


def _shown(name: str) -> str:
    return name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."


def check_sequence(sequence: list[int], where: str, what: str, param: str, engine: ScoringEngine,
                   too_long: ErrorSpec = ERRORS.context_length_exceeded) -> None:
    """A sequence to run: not empty (nothing to predict from), not longer than the longest length bucket (inputs
    are never truncated: `too_long`, context_length_exceeded, may say how to cut them). `where` and `what` name it in
    the message ("items[3]", "the sequence")."""
    if not sequence:
        raise ERRORS.empty_sequence(param, where=where, what=what)
    limit = engine.max_sequence_length
    if len(sequence) > limit:
        raise too_long(param, where=where, what=what, length=len(sequence), limit=limit)


def require_language_model(engine: ScoringEngine) -> None:
    """/v1/score and /v1/completions read a language-model head; a sequence-classification checkpoint has none."""
    if engine.task != "causal_lm":
        raise ERRORS.model_not_supported(model=engine.model_id)
