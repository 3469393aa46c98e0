"""Validation shared by every endpoint: the body, one field of a given type, token IDs, inputs, the size
limits, `model`.

The request structs hold each field as `msgspec.Raw` (handler.schemas says why); `required`, `optional` and
`decode_field` decode one field at the point the endpoint's order reaches it. Type checks are msgspec's strict
ones: `true`/`1`/`"true"` are not interchangeable, `2.5`/`"3"` are not IDs. A JSON null counts as the field being
absent. Each endpoint's own rules are in its module (handler.score, handler.classify, handler.rerank,
handler.completions).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from handler.errors import ApiError
from handler.schemas import TokenizeRequest
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


def validate_tokenize_request(request: TokenizeRequest) -> tuple[str, bool]:
    text = required(request.text, str, "text")
    add_special_tokens = optional(request.add_special_tokens, bool, "add_special_tokens", False)
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
        raise ApiError("invalid_json", f"{param} is not valid JSON: {exc}", param) from None


def required(raw: msgspec.Raw, type_: Any, name: str, kind: str | None = None) -> Any:
    """A required field of `type_`: missing_<name> when absent or null, invalid_<name>_type ("<name> must be
    <kind>"; `kind` defaults to the type's name for bool, int, float and str) when of another type."""
    kind = kind or _KINDS[type_]  # up front: a type with no kind fails on every call, not only on a wrong value
    if not is_given(raw):
        raise ApiError(f"missing_{name}", f"{name} is required", name)
    return _typed(raw, type_, name, kind)


def optional(raw: msgspec.Raw, type_: Any, name: str, default: Any, kind: str | None = None) -> Any:
    """An optional field of `type_` (absent or null: `default`), else as `required`'s invalid_<name>_type."""
    kind = kind or _KINDS[type_]
    if not is_given(raw):
        return default
    return _typed(raw, type_, name, kind)


def _typed(raw: msgspec.Raw, type_: Any, name: str, kind: str) -> Any:
    value = decode_field(raw, type_, name)
    if value is INVALID:
        raise ApiError(f"invalid_{name}_type", f"{name} must be {kind}", name)
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
        raise ApiError("negative_token_id", f"{param} cannot contain negative values. Got: {negatives}", param)
    if max(ids) >= vocab_size:
        too_big = next(i for i in ids if i >= vocab_size)
        raise ApiError("token_id_exceeds_vocab", f"{param} contains token ID {too_big} which exceeds vocabulary "
                       f"size {vocab_size} (valid IDs are 0 to {vocab_size - 1})", param)


def check_count(count: int, limit: int, param: str, code: str = "too_many_items") -> None:
    """At most `limit` entries in the list field `param`: too_many_items (every scoring endpoint's inputs), or
    the `code` given (/v1/score's too_many_labels, /v1/completions' invalid_stop)."""
    if count > limit:
        raise ApiError(code, f"{param} has {count} entries, more than the limit of {limit}.", param)


def check_total_tokens(sequences: list[list[int]], limit: int, what: str, param: str) -> int:
    """The request's tokens in total (usage.prompt_tokens), at most `limit` (too_many_tokens); `what` names the
    sequences in the message ("prompts", "query-document pairs")."""
    n_tokens = sum(map(len, sequences))
    if n_tokens > limit:
        raise ApiError("too_many_tokens", f"The request's {what} have {n_tokens} tokens in total, "
                       f"more than the limit of {limit}.", param)
    return n_tokens


def decode_inputs(raw: msgspec.Raw, name: str, vocab_size: int, purpose: str,
                  blank_ok: bool = False) -> tuple[list[str] | list[list[int]], bool]:
    """A field that is a text, a list of texts, token IDs or a list of token-ID lists (/v1/classify's `input`,
    /v1/completions' `prompt`): (the inputs as a list, whether the field was a list). Codes: missing_<name>,
    invalid_<name>_type, empty_<name> (also for an empty element; for a whitespace-only text unless
    `blank_ok`), and the token-range codes. `purpose` ends the empty message: "there is nothing to <purpose>"."""
    if not is_given(raw):
        raise ApiError(f"missing_{name}", f"{name} is required", name)
    for form, is_list in _INPUT_FORMS:
        value = decode_field(raw, form, name)
        if value is not INVALID:
            break
    else:
        raise ApiError(f"invalid_{name}_type", f"{name} must be a string, a list of strings, a list of token IDs "
                       "or a list of token-ID lists", name)
    inputs = value if is_list else [value]
    tokens = bool(inputs) and isinstance(inputs[0], list)
    if tokens and not all(map(fits_int64, inputs)):
        raise ApiError(f"invalid_{name}_type", f"{name} token IDs must be integers within the signed 64-bit range",
                       name)
    if not inputs:
        raise ApiError(f"empty_{name}", f"{name} cannot be empty. At least one {name} is required.", name)
    for index, item in enumerate(inputs):
        if not item or (isinstance(item, str) and not blank_ok and not item.strip()):
            where = f"{name}[{index}]" if is_list else name
            blank = " or whitespace only" if not tokens and not blank_ok else ""
            raise ApiError(f"empty_{name}", f"{where} is empty{blank}; there is nothing to {purpose}.", name)
    if tokens:
        for item in inputs:
            check_token_range(item, name, vocab_size)
    return inputs, is_list


def served_model(raw: msgspec.Raw, engine: ScoringEngine) -> tuple[str, str | None]:
    """`model`: absent, null or the served model's id (the base model), or a LoRA adapter's name; anything else is
    model_not_found. Returns (the name answered as `model`, the adapter or None)."""
    model = optional(raw, str, "model", None)
    if model is None or model == engine.model_id:
        return engine.model_id, None
    if model in adapter_heads(engine.classifiers):
        raise ApiError("model_not_supported", f"LoRA adapter '{model}' is a classifier (its own classification "
                       "head): use /v1/classify.", "model")
    if model in engine.adapters:
        return model, model
    raise ApiError("model_not_found", f"Model '{_shown(model)}' not found. Available models: "
                   f"{[engine.model_id, *engine.adapters]}", "model")


def select_named(raw: msgspec.Raw, choices: tuple, engine: ScoringEngine, kind: str,
                 missing: str) -> tuple[Any, str | None]:
    """`model` naming one of `choices` (classifiers, rerankers; each has a `.name`), or a LoRA adapter (the first
    choice, run with it): absent, null or the served model's own id select the first. `missing` says how to get one
    when there is none (model_not_supported). Returns (the choice, the adapter or None)."""
    name, model_id = optional(raw, str, "model", None), engine.model_id
    if not choices:
        raise ApiError("model_not_supported", f"The served model '{model_id}' has no {kind}: {missing}")
    if name is None or (name == model_id and name not in (c.name for c in choices)):
        return choices[0], None
    for choice in choices:
        if choice.name == name:
            return choice, None
    if name in engine.adapters:
        if name in adapter_heads(engine.classifiers):
            raise ApiError("model_not_supported", f"LoRA adapter '{name}' is a classifier (its own classification "
                           f"head), not a {kind}: use /v1/classify.", "model")
        return choices[0], name
    adapters = f" and LoRA adapters: {list(engine.adapters)}" if engine.adapters else ""
    raise ApiError("model_not_found", f"Model '{_shown(name)}' not found. Available {kind}s: "
                   f"{[c.name for c in choices]}{adapters}", "model")


def _shown(name: str) -> str:
    return name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."


def check_sequence(sequence: list[int], where: str, what: str, param: str, engine: ScoringEngine,
                   hint: str = "") -> None:
    """A sequence to run: not empty (nothing to predict from), not longer than the longest length bucket (inputs
    are never truncated). `where` and `what` name it in the message ("items[3]", "the sequence")."""
    if not sequence:
        raise ApiError("empty_sequence", f"{where}: {what} has no token.", param)
    limit = engine.max_sequence_length
    if len(sequence) > limit:
        raise ApiError("context_length_exceeded", f"{where}: {what} has {len(sequence)} tokens, more than the "
                       f"maximum sequence length of {limit} tokens.{hint}", param)


def require_language_model(engine: ScoringEngine) -> None:
    """/v1/score and /v1/completions read a language-model head; a sequence-classification checkpoint has none."""
    if engine.task != "causal_lm":
        raise ApiError("model_not_supported", f"The served model '{engine.model_id}' is a sequence-classification "
                       "model: it has no language-model head to score tokens with. Use POST /v1/classify.")
