"""The engine's spans, written only while tracing is on (runtime.tracing).

A submitted request's admission, its wait in the queue and each device round it joined are children of the span
current when it was submitted (the HTTP request's: handler.tracing). A device round serves many requests, so it
is a trace of its own, linked to each of them (and each request's child span of it links back). Attribute names
are scorefn.*: OpenTelemetry has no conventions for them.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode

from runtime import tracing
from runtime.interface import Prediction
from runtime.requests.slices import Admission, Round


def request_trace() -> RequestTrace | None:
    """A submitted request's spans, under the current span; None when none is recording (the request is not
    traced, or its trace was sampled out)."""
    return RequestTrace() if trace.get_current_span().is_recording() else None


class RequestTrace:
    """One submitted request's spans, under the span current when it was submitted."""

    def __init__(self) -> None:
        self.parent = otel_context.get_current()
        self.request = trace.get_current_span(self.parent).get_span_context()
        self.submitted_ns = time.time_ns()
        self.queued_ns = 0  # when it joined the queue
        self.left = False  # its wait in the queue is written

    def queued(self) -> None:
        """It joins the queue (called under the scheduler's lock: the device thread may take it at once)."""
        self.queued_ns = time.time_ns()

    def admitted(self, admission: Admission) -> None:
        self._span("admission", self.submitted_ns, self.queued_ns, {
            **tracing.admission_attributes(Prediction(admission.wait_s, admission.own_s)),
            "scorefn.admission.load": admission.load})

    def refused(self, error: Exception) -> None:
        self._span("admission", self.submitted_ns, time.time_ns(), tracing.admission_attributes(None, error),
                   message=str(error))

    def left_queue(self, round_number: int | None, end_ns: int) -> None:
        """Its wait in the queue ends (the device thread): its first slice is in a round, or it is dropped
        (`round_number` None)."""
        if not self.left:
            self.left = True
            attributes = {"scorefn.round.id": round_number} if round_number is not None else {
                "scorefn.queue.dropped": True}
            self._span("queue", self.queued_ns, end_ns, attributes)

    def joined(self, round: Round, attributes: dict[str, Any], rows: int, round_span: Any, end_ns: int) -> None:
        """Its span of a device round that computed `rows` of it (the round's `attributes`), linked to the round's."""
        self._span("device round", tracing.epoch_ns(round.started), end_ns,
                   {**attributes, "scorefn.round.request_rows": rows},
                   links=[Link(round_span.get_span_context())], message=_error(round))

    def _span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any], links: list = (),
              message: str | None = None) -> None:
        span = tracing.tracer.start_span(name, context=self.parent, attributes=attributes, links=links,
                                         start_time=start_ns)
        if message is not None:
            span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_ns)


def started(phases: list[tuple[str, float, float]], model_id: str, platform: dict[str, str],
            timings: dict[str, float]) -> None:
    """The start as a trace of its own: a span from the process's start to ready, a child per phase (boot, import,
    load, compile, calibrate: (name, began, ended) in time.monotonic() seconds), with what the start did."""
    attributes = {"scorefn.model": model_id, **{f"scorefn.platform.{key}": value for key, value in platform.items()},
                  **{f"scorefn.startup.{key}": value for key, value in timings.items()}}
    start = tracing.tracer.start_span("start", attributes=attributes, start_time=tracing.epoch_ns(phases[0][1]))
    parent = trace.set_span_in_context(start)
    for name, began, ended in phases:
        tracing.tracer.start_span(name, context=parent, start_time=tracing.epoch_ns(began)).end(
            tracing.epoch_ns(ended))
    start.end(tracing.epoch_ns(phases[-1][2]))


def round_started(round: Round) -> None:
    """The requests whose first slice is in this round stop waiting in the queue."""
    started_ns = tracing.epoch_ns(round.started)
    for piece in round.slices:
        if piece.entry.trace is not None:
            piece.entry.trace.left_queue(round.number, started_ns)


def round_finished(round: Round, buckets: list[str]) -> None:
    """The round's span, linked to every request it served, and each request's span of it."""
    end_ns = time.time_ns()
    traced = [piece for piece in round.slices if piece.entry.trace is not None]
    if not traced:
        return
    links = [Link(piece.entry.trace.request, {"scorefn.request_id": str(piece.entry.request_id),
                                              "scorefn.round.request_rows": piece.stop - piece.start})
             for piece in traced]
    attributes = {**_round_attributes(round), "scorefn.round.buckets": buckets}
    span = tracing.tracer.start_span("device round", attributes=attributes, links=links,
                                     start_time=tracing.epoch_ns(round.started))
    if round.error is not None:
        span.record_exception(round.error)
        span.set_status(Status(StatusCode.ERROR, _error(round)))
    span.end(end_ns)
    for piece in traced:
        piece.entry.trace.joined(round, attributes, piece.stop - piece.start, span, end_ns)


def _round_attributes(round: Round) -> dict[str, Any]:
    return {"scorefn.round.id": round.number, "scorefn.round.requests": len(round.slices),
            "scorefn.round.rows": sum(piece.stop - piece.start for piece in round.slices),
            "scorefn.round.device_batches": round.work.batches, "scorefn.round.padded_tokens": round.work.tokens,
            "scorefn.round.predicted_s": round.predicted_s}


def _error(round: Round) -> str | None:
    return None if round.error is None else f"the device round failed: {type(round.error).__name__}"
