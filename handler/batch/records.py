"""The output: one OpenAI batch output record per input line, and the file they go to, resumable after a crash.

A record: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}. `body` is exactly what
the endpoint answered over HTTP (the RFC-006 envelope on an error). `error` is null on a 200 and the envelope's
{code, message} otherwise, so that failed lines are found by one field. A line refused before it reached an
endpoint (lines.Refusal) has the same shape, its status the one HTTP would give; a line without a custom_id
carries its `line` number instead.

Records are appended one write each. A job killed at any moment leaves at most a torn last line, which opening
the file again cuts off (its line is answered again); a bad line before the last is not ours to cut, so opening
refuses the file.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import msgspec

from handler.http import error_response
from handler.batch.lines import Key, Refusal


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    request_id: str
    body: bytes  # JSON: the endpoint's answer


class ResponseData(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class ErrorData(msgspec.Struct):
    code: str
    message: str


class OutputRecord(msgspec.Struct, omit_defaults=True):
    id: str
    custom_id: str | None
    response: ResponseData | None
    error: ErrorData | None
    line: int | None = None  # only on a line without a custom_id


class _RecordKey(msgspec.Struct):
    custom_id: str | None = None
    line: int | None = None


class _Envelope(msgspec.Struct):
    error: ErrorData


_ENCODER = msgspec.json.Encoder()
_RECORD_KEY = msgspec.json.Decoder(_RecordKey)
_ENVELOPE = msgspec.json.Decoder(_Envelope)


def record(key: Key, answer: Answer) -> tuple[bytes, str | None]:
    """(the record as one JSONL line, its error code or None)."""
    error = None
    if answer.status != 200:
        try:
            envelope = _ENVELOPE.decode(answer.body).error
            error = ErrorData(envelope.code, envelope.message)
        except msgspec.DecodeError:  # not scorefn's envelope (a proxy's page): its status is all there is
            error = ErrorData(f"http_{answer.status}", answer.body[:200].decode("utf-8", "replace"))
    out = OutputRecord(id=f"batch_req_{uuid.uuid4().hex}", custom_id=key if isinstance(key, str) else None,
                       response=ResponseData(answer.status, answer.request_id, msgspec.Raw(answer.body)),
                       error=error, line=key if isinstance(key, int) else None)
    return _ENCODER.encode(out) + b"\n", error.code if error else None


def refused(refusal: Refusal) -> Answer:
    """What HTTP would have answered a line that never reached an endpoint."""
    response = error_response(refusal.error)
    return Answer(response.status, uuid.uuid4().hex, response.body)


def record_key(raw: bytes) -> Key:
    """The key of a record line; ValueError when it is not a record."""
    try:
        fields = _RECORD_KEY.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(str(exc)) from None
    if fields.custom_id is not None:
        return fields.custom_id
    if fields.line is not None:
        return fields.line
    raise ValueError("neither custom_id nor line")


def scan_records(path: Path) -> tuple[dict[Key, tuple[int, int]], int]:
    """(every whole record's (offset, length) by key, the byte length of the whole ones). A torn last line is left
    out; a bad line before it raises ValueError naming it. Offsets, not records: a million-line file stays on disk."""
    found: dict[Key, tuple[int, int]] = {}
    good = 0
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("no newline")
                key = record_key(raw)
            except ValueError as exc:
                if file.read(1):  # not the last line
                    raise ValueError(f"{path}: line {number} is not an output record ({exc}); was the file "
                                     "written by another program?") from None
                break
            found.setdefault(key, (good, len(raw)))
            good += len(raw)
    return found, good


class OutputFile:
    """An output file opened to go on: what it already answers, and appends of whole records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        answered, good = scan_records(path) if path.exists() else ({}, 0)
        self.answered = set(answered)
        self.cut_bytes = path.stat().st_size - good if path.exists() else 0  # a torn last line, redone
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, good)
        os.lseek(self._fd, good, os.SEEK_SET)

    def write(self, line: bytes) -> None:
        view = memoryview(line)
        while view:
            view = view[os.write(self._fd, view):]

    def sync(self) -> None:
        """To the disk (a killed process loses nothing written; a lost machine loses what is not synced)."""
        os.fsync(self._fd)

    def close(self) -> None:
        self.sync()
        os.close(self._fd)

