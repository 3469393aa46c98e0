"""The framework-free HTTP exchange the core works on: what a face hands in, what it gets back."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Mapping
import msgspec

from handler.classify import ClassifyJob
from handler.errors import ApiError
from handler.rerank import RerankJob
from handler.schemas import ENCODER, ErrorBody, ErrorEnvelope
from handler.validation import ScoreJob

JSON = "application/json"
_MAX_REQUEST_ID_CHARS = 128


@dataclasses.dataclass(frozen=True)
class HttpRequest:
    method: str  # upper case
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: bytes | None  # None: the body is larger than max_body_bytes and was left unread
    started: float = dataclasses.field(default_factory=time.perf_counter)  # for x-total-time


@dataclasses.dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: list[tuple[str, str]]  # content-type included
    body: bytes

    @property
    def media_type(self) -> str:
        return next((value for name, value in self.headers if name == "content-type"), JSON)


@dataclasses.dataclass(frozen=True)
class PendingScore:
    """A scoring request (/v1/score, /v1/classify, /v1/rerank) handed to the engine; the face waits on `future`,
    then calls core.finish."""
    request: HttpRequest
    request_id: str
    job: ScoreJob | ClassifyJob | RerankJob
    future: concurrent.futures.Future


def json_response(status: int, payload: msgspec.Struct, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    return HttpResponse(status, [("content-type", JSON), *(headers or [])], ENCODER.encode(payload))


def error_response(error: ApiError) -> HttpResponse:
    spec = error.spec
    extra = list(error.headers)
    if spec.retry_after_s is not None:
        extra.append(("retry-after", str(spec.retry_after_s)))
    envelope = ErrorEnvelope(error=ErrorBody(message=error.message, type=spec.type, param=error.param, code=error.code))
    return json_response(spec.status, envelope, extra)


def request_id_of(request: HttpRequest) -> str:
    """The client's x-request-id when it is short printable ASCII (it is echoed in a header), else a new one."""
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= _MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


def seconds(value: float) -> str:
    """Timing header value: seconds as a plain decimal string, microsecond resolution."""
    return f"{max(value, 0.0):.6f}"
