"""The framework-free HTTP exchange the core works on: what a face hands in, what it gets back."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
import numpy as np

from handler.errors import ApiError
from handler.schemas import ENCODER, ErrorBody, ErrorEnvelope, PromptTokensDetails
from handler.tracing import SpanHooks
from runtime.interface import Prediction, ScoreResult, ScoringEngine
from runtime.settings import Settings

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
    error_code: str | None = None  # an error's RFC-006 code (its span says it)

    @property
    def media_type(self) -> str:
        return next((value for name, value in self.headers if name == "content-type"), JSON)


class ValidatedRequest(Protocol):
    """A validated request of a scoring endpoint."""
    sequences: list[list[int]]  # what the engine computes, one row each
    n_tokens: int  # their tokens (usage.prompt_tokens)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How a scoring endpoint turns a request into engine work, and the engine's result into its answer
    (each endpoint's module defines one; handler.core routes to it)."""
    decoder: msgspec.json.Decoder  # the body -> its request struct
    validate: Callable[[Any, ScoringEngine, Settings], ValidatedRequest]  # raises ApiError in the endpoint's order
    submit: Callable[[ScoringEngine, Any, float, str], concurrent.futures.Future]
    respond: Callable[[Any, Any, ScoringEngine], msgspec.Struct]  # (job, the engine's result) -> the 200 body


def submit_labels(engine: ScoringEngine, job: Any, deadline: float, request_id: str) -> concurrent.futures.Future:
    """Score the job's label tokens after each of its sequences (/v1/score, /v1/classify, /v1/rerank)."""
    return engine.submit(job.sequences, job.label_ids, deadline, request_id=request_id, adapter=job.adapter,
                         cache_salt=job.cache_salt)


def cached(result: Any) -> PromptTokensDetails:
    """usage.prompt_tokens_details: the prompt tokens the prefix cache held (runtime.requests.prefix_cache)."""
    return PromptTokensDetails(cached_tokens=result.cached_tokens)


def label_values(job: Any, result: ScoreResult) -> np.ndarray:
    """The engine's answer to submit_labels: [sequences, labels]. Validation counted the labels once; a result of
    another shape is the engine's bug, which no request can cause, and a 500 rather than a wrong answer."""
    values = np.asarray(result.logprobs)
    expected = (len(job.sequences), len(job.label_ids))
    if values.shape != expected:
        raise ValueError(f"engine returned scores of shape {values.shape}, expected {expected}")
    return values


@dataclasses.dataclass(frozen=True)
class PendingScore:
    """A scoring request handed to the engine; the face waits on `future`, then calls core.finish."""
    request: HttpRequest
    request_id: str
    job: ValidatedRequest
    future: concurrent.futures.Future
    scoring: Scoring
    span: SpanHooks  # the request's span, ended when its answer is built


def json_response(status: int, payload: msgspec.Struct, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    return HttpResponse(status, [("content-type", JSON), *(headers or [])], ENCODER.encode(payload))


def error_response(error: ApiError) -> HttpResponse:
    spec = error.spec
    extra = list(error.headers)
    if spec.retry_after_s is not None and not any(name == "retry-after" for name, _ in extra):
        extra.append(("retry-after", str(spec.retry_after_s)))  # the default, unless the error says when
    envelope = ErrorEnvelope(error=ErrorBody(message=error.message, type=spec.type, param=error.param, code=error.code))
    return dataclasses.replace(json_response(spec.status, envelope, extra), error_code=error.code)


def request_id_of(request: HttpRequest) -> str:
    """The client's x-request-id when it is short printable ASCII (it is echoed in a header), else a new one."""
    given = request.headers.get("x-request-id", "")
    if 0 < len(given) <= _MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


def seconds(value: float) -> str:
    """Timing header value: seconds as a plain decimal string, microsecond resolution."""
    return f"{max(value, 0.0):.6f}"


def predicted_headers(predicted: Prediction | None) -> list[tuple[str, str]]:
    """What admission predicted, beside the measured x-queue-time and x-device-time (on a 429 too)."""
    if predicted is None:
        return []
    return [("x-predicted-queue-time", seconds(predicted.queue_seconds)),
            ("x-predicted-device-time", seconds(predicted.device_seconds))]
