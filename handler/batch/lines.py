"""The input: OpenAI's batch file format, one request per line: {"custom_id", "method", "url", "body"}.

A line that cannot reach an endpoint (not JSON, no custom_id, another method, a url scorefn does not batch) is
a Refusal with the RFC-006 code it would get over HTTP; its body goes to the endpoint as the bytes given, so
the endpoint refuses a bad body exactly as it would over HTTP. Blank lines are not requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import msgspec

from handler.core import ENDPOINTS
from handler.errors import ERRORS, ApiError

# Every endpoint that scores (the routing table says which): what a batch line may name.
BATCH_URLS = tuple(path for path, endpoint in ENDPOINTS.items() if endpoint.scoring is not None)
_SHOWN_CHARS = 100

Key = str | int  # a line's identity: its custom_id, or its line number when it has no usable custom_id


@dataclasses.dataclass(frozen=True)
class Line:
    number: int  # 1-based, counting every line of the file (what an editor shows)
    index: int  # 0-based among the requests (blank lines skipped): what shards split on
    raw: bytes


@dataclasses.dataclass(frozen=True)
class Request:
    """A line for an endpoint."""
    key: Key
    line: int
    url: str
    body: bytes  # exactly the bytes of the line's "body"
    items: int  # sequences it asks for (0 when the body is not what the endpoint reads; it refuses it then)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A line that never reaches an endpoint."""
    key: Key
    line: int
    error: ApiError


class _BatchLine(msgspec.Struct):
    custom_id: msgspec.Raw = msgspec.UNSET
    method: msgspec.Raw = msgspec.UNSET
    url: msgspec.Raw = msgspec.UNSET
    body: msgspec.Raw = msgspec.UNSET


class _Identity(msgspec.Struct):
    custom_id: object = None


_LINE = msgspec.json.Decoder(_BatchLine)
_IDENTITY = msgspec.json.Decoder(_Identity)
_TEXT = msgspec.json.Decoder(object)


def read_lines(path: Path) -> Iterator[Line]:
    index = 0
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield Line(number, index, raw)
                index += 1


def key_of(line: Line) -> Key:
    """The custom_id when it is a non-empty string, else the line number."""
    try:
        custom_id = _IDENTITY.decode(line.raw).custom_id
    except (msgspec.DecodeError, RecursionError):
        return line.number
    return custom_id if isinstance(custom_id, str) and custom_id else line.number


class DuplicateIds(Exception):
    """Two lines share a custom_id: the answers could not be told apart."""


def keys(path: Path) -> list[Key]:
    """Every request's key in input order; DuplicateIds names the first two custom_ids given twice."""
    first_line: dict[Key, int] = {}
    out, duplicates = [], []
    for line in read_lines(path):
        key = key_of(line)
        if key in first_line and len(duplicates) < 2:
            duplicates.append(f"{key[:_SHOWN_CHARS]!r} on lines {first_line[key]} and {line.number}")
        first_line.setdefault(key, line.number)
        out.append(key)
    if duplicates:
        raise DuplicateIds(f"{path}: custom_id given twice: {'; '.join(duplicates)}. Every line needs its own "
                           "custom_id: the answers are matched to the lines by it.")
    return out


def parse(line: Line, key: Key) -> Request | Refusal:
    """The line as a request for an endpoint, or why it cannot be one; `key`: key_of(line), which the caller has."""
    try:
        fields = _LINE.decode(line.raw)
    except msgspec.ValidationError:
        return Refusal(key, line.number, ERRORS.line_not_object(line=line.number))
    except (msgspec.DecodeError, RecursionError) as exc:
        return Refusal(key, line.number, ERRORS.line_not_json(line=line.number, reason=exc))
    if isinstance(key, int):
        return Refusal(key, line.number, ERRORS.line_without_id(line=line.number))
    method = _string(fields.method)
    if method != "POST":
        return Refusal(key, line.number, ERRORS.line_method_not_allowed(line=line.number, method=_shown(method)))
    url = _string(fields.url)
    if url not in BATCH_URLS:
        return Refusal(key, line.number, ERRORS.line_url_unknown(line=line.number, url=_shown(url),
                                                                 urls=", ".join(BATCH_URLS)))
    body = bytes(fields.body) if fields.body is not msgspec.UNSET else b""
    return Request(key, line.number, url, body, items_of(url, body))


def _string(raw: msgspec.Raw | msgspec.UnsetType) -> object:
    return None if raw is msgspec.UNSET else _TEXT.decode(raw)


def _shown(value: object) -> str:
    return "missing" if value is None else repr(value)[:_SHOWN_CHARS]


# The field each endpoint reads its sequences from: a list of them, or one (a string or a list of token IDs).
_SEQUENCES_FIELD = {"/v1/score": "items", "/v1/classify": "input", "/v1/completions": "prompt"}


def items_of(url: str, body: bytes) -> int:
    """How many sequences a body asks for (for progress and items/s; the endpoint does the validating)."""
    try:
        fields = _TEXT.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return 0
    if not isinstance(fields, dict):
        return 0
    value = fields.get(_SEQUENCES_FIELD.get(url, "documents"))
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return 1 if isinstance(value, (str, list)) and url != "/v1/score" else 0
