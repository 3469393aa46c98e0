"""A span per HTTP request while tracing is on (runtime.tracing); with it off, `request_span` hands out OFF, whose
hooks do nothing, and no OpenTelemetry module is imported. A request whose trace is sampled out records nothing, but
its trace's ids still reach its log lines.

The span continues the caller's trace: the W3C `traceparent` header, else Cloud Run's `X-Cloud-Trace-Context`. It
is the current span while the core works on the request, so the engine's spans of it (admission, queue, device
rounds: runtime.requests.spans) become its children and every log line written meanwhile carries its ids
(handler.logs). Its own children: `validate` (JSON decoding and the endpoint's checks), `tokenize` (the
tokenizer's calls during validation) and `encode` (the response body). Attributes follow OpenTelemetry's HTTP
server conventions (http.request.method, http.route, url.path, http.response.status_code, error.type on a 5xx,
user_agent.original) and add scorefn.* ones (request id, items, tokens, the RFC-006 error code, the admission's
decision on a 429).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from runtime import tracing
from runtime.interface import QueueFull, ScoringEngine

_MAX_PATH_CHARS = 512
_METHODS = {"GET", "POST", "OPTIONS", "HEAD", "PUT", "DELETE", "PATCH", "CONNECT", "TRACE"}


class SpanHooks:
    """What the core calls on a request's span. As is, every hook does nothing: what request_span() hands out
    while tracing is off (OFF)."""

    def current(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def child(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def validating(self, engine: ScoringEngine) -> ScoringEngine:
        return engine

    def tokenized(self) -> None:
        pass

    def refused(self, error: QueueFull) -> None:
        pass

    def end(self, status: int, body_bytes: int, error_code: str | None, job: Any, result: Any) -> None:
        pass


OFF = SpanHooks()


class _SampledOut(SpanHooks):
    """A request whose trace is sampled out: its span records nothing, but while it is current the log lines carry
    the trace's ids."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def current(self) -> contextlib.AbstractContextManager:
        return _api().use_span(self.span, end_on_exit=False)


class RequestSpan(_SampledOut):
    """One HTTP request's recording server span."""

    def __init__(self, span: Any) -> None:
        super().__init__(span)
        self._tokenizer: _TimedTokenizer | None = None

    @contextlib.contextmanager
    def child(self, name: str) -> Iterator[None]:
        with self.current(), tracing.tracer.start_as_current_span(name):
            yield

    def validating(self, engine: ScoringEngine) -> ScoringEngine:
        """The engine as an endpoint's validation sees it, its tokenizer's calls timed (see tokenized())."""
        self._tokenizer = _TimedTokenizer(engine)
        return self._tokenizer  # type: ignore[return-value]

    def tokenized(self) -> None:
        """A `tokenize` span (a child of the current one: `validate`) for the tokenizer's calls during validation:
        from the first one's start to the last one's end, with their number and the seconds they took (the checks
        between them took the rest)."""
        timed = self._tokenizer
        if timed is not None and timed.calls:
            tracing.tracer.start_span("tokenize", start_time=timed.first_ns, attributes={
                "scorefn.tokenize.calls": timed.calls, "scorefn.tokenize.seconds": timed.seconds,
                "scorefn.tokenize.tokens": timed.tokens}).end(timed.last_ns)

    def refused(self, error: QueueFull) -> None:
        """The admission's decision on a 429 (its own span has the details: runtime.requests.spans)."""
        self.span.set_attributes(tracing.admission_attributes(None, error))

    def end(self, status: int, body_bytes: int, error_code: str | None, job: Any, result: Any) -> None:
        attributes: dict[str, Any] = {"http.response.status_code": status, "http.response.body.size": body_bytes}
        if error_code is not None:
            attributes["scorefn.error.code"] = error_code
        if job is not None:
            attributes.update({"scorefn.items": len(job.sequences), "scorefn.tokens": job.n_tokens})
        if result is not None:
            attributes.update({"scorefn.queue_s": result.queue_seconds, "scorefn.device_s": result.device_seconds})
            if result.predicted is not None:
                attributes.update(tracing.admission_attributes(result.predicted))
        self.span.set_attributes(attributes)
        if status >= 500:  # a server span's 4xx is the client's error, not the span's (HTTP conventions)
            self.span.set_attributes({"error.type": str(status)})
            self.span.set_status(_api().Status(_api().StatusCode.ERROR, error_code))
        self.span.end()


def request_span(method: str, path: str, headers: Any, route: str | None, started: float, body_bytes: int | None,
                 request_id: str) -> SpanHooks:
    """The request's span, started when the face got the request (`started`, a time.perf_counter() value): OFF
    while tracing is off, a RequestSpan when its trace is sampled."""
    if tracing.tracer is None:
        return OFF
    method = method if method in _METHODS else "_OTHER"
    attributes: dict[str, Any] = {"http.request.method": method, "url.path": path[:_MAX_PATH_CHARS],
                                  "scorefn.request_id": request_id}
    if route is not None:
        attributes["http.route"] = route
    if user_agent := headers.get("user-agent"):
        attributes["user_agent.original"] = user_agent
    if body_bytes is not None:
        attributes["http.request.body.size"] = body_bytes
    span = tracing.tracer.start_span(
        f"{method} {route}" if route else method, context=_propagation().extract(headers),
        kind=_api().SpanKind.SERVER, attributes=attributes,
        start_time=tracing.epoch_ns(started, time.perf_counter))
    return RequestSpan(span) if span.is_recording() else _SampledOut(span)


class _TimedTokenizer:
    """An engine whose tokenize() calls are counted and timed; everything else is the engine's."""

    def __init__(self, engine: ScoringEngine) -> None:
        self._engine = engine
        self.calls = self.tokens = self.first_ns = self.last_ns = 0
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        began = time.time_ns()
        tokens = self._engine.tokenize(text, add_special_tokens=add_special_tokens)
        self.last_ns = time.time_ns()
        self.first_ns = self.first_ns or began
        self.calls += 1
        self.tokens += len(tokens)
        self.seconds += (self.last_ns - began) / 1e9
        return tokens


def _api() -> Any:
    """opentelemetry.trace (imported once tracing is on)."""
    from opentelemetry import trace

    return trace


@functools.cache
def _propagation() -> Any:
    """traceparent (W3C) when present, else X-Cloud-Trace-Context: the last propagator that finds one wins."""
    from opentelemetry.propagators.cloud_trace_propagator import CloudTraceFormatPropagator
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return CompositePropagator([CloudTraceFormatPropagator(), TraceContextTextMapPropagator()])
