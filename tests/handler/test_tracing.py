"""Traces, captured in process by the SDK's in-memory exporter: a span per request on both faces, continuing the
caller's trace, with its children (validation, tokenization, encoding) and the engine's (admission, queue, device
round) for a scored request, a refused one and a failed one; log lines carry its ids. Tracing off writes nothing."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from handler.asgi import create_app
from handler.logs import JsonLineFormatter
from runtime import tracing
from runtime.interface import EngineFault, Prediction, QueueFull
from runtime.requests.cost import KINDS, ServiceModel
from runtime.engine import Engine
from tests.handler.clients import AsgiClient
from tests.handler.conftest import make_settings, score_body, serve
from tests.handler.fake_engine import FakeEngine
from tests.runtime.engine.stubs import TokenCountCost

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
WAIT_S = 30.0


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider, project="my-project")
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def server_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    return span


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id}


def test_a_scored_request_continues_the_callers_trace_with_its_steps_as_children(face, settings, engine, spans):
    with serve(face, settings, engine) as client:
        reply = client.post("/v1/score", json=score_body(), headers={"traceparent": TRACEPARENT,
                                                                     "x-request-id": "abc", "user-agent": "t/1"})
    assert reply.status == 200
    span = server_span(spans)
    assert span.name == "POST /v1/score"
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_ID
    assert span.status.status_code == StatusCode.UNSET
    attributes = dict(span.attributes)
    assert {key: attributes[key] for key in ("http.request.method", "http.route", "url.path", "user_agent.original",
                                             "http.response.status_code", "scorefn.request_id", "scorefn.items",
                                             "scorefn.tokens")} == {
        "http.request.method": "POST", "http.route": "/v1/score", "url.path": "/v1/score", "user_agent.original": "t/1",
        "http.response.status_code": 200, "scorefn.request_id": "abc", "scorefn.items": 2, "scorefn.tokens": 9}
    assert attributes["scorefn.queue_s"] == 0.25 and attributes["scorefn.device_s"] == 0.5
    steps = children(spans, span)
    assert set(steps) == {"validate", "encode"}
    steps.update(children(spans, steps["validate"]))
    assert set(steps) == {"validate", "tokenize", "encode"}
    assert steps["tokenize"].attributes["scorefn.tokenize.calls"] == 2  # one per item (query + item)
    assert steps["tokenize"].attributes["scorefn.tokenize.tokens"] == 9
    assert steps["validate"].start_time <= steps["tokenize"].start_time <= steps["tokenize"].end_time \
        <= steps["validate"].end_time <= steps["encode"].start_time
    assert span.start_time <= steps["validate"].start_time and steps["encode"].end_time <= span.end_time


def test_cloud_runs_trace_header_is_continued(face, settings, engine, spans):
    with serve(face, settings, engine) as client:
        client.post("/v1/score", json=score_body(), headers={"x-cloud-trace-context": f"{TRACE_ID}/12345;o=1"})
    span = server_span(spans)
    assert format(span.context.trace_id, "032x") == TRACE_ID and span.parent.span_id == 12345


def test_without_a_trace_header_a_request_starts_a_trace(face, settings, engine, spans):
    with serve(face, settings, engine) as client:
        client.get("/v1/models")
    span = server_span(spans)
    assert span.parent is None and span.name == "GET /v1/models"
    assert span.attributes["http.response.status_code"] == 200


def test_a_refused_request_has_the_admission_decision_on_its_span(face, settings, engine, spans):
    engine.raise_on_submit = QueueFull("busy", retry_after_s=3, reason="wait", predicted=Prediction(2.5, 0.1))
    with serve(face, settings, engine) as client:
        reply = client.post("/v1/score", json=score_body(), headers={"traceparent": TRACEPARENT})
    assert reply.status == 429
    span = server_span(spans)
    assert {key: value for key, value in span.attributes.items() if key.startswith("scorefn.admission.")} == {
        "scorefn.admission.decision": "refused", "scorefn.admission.reason": "wait",
        "scorefn.admission.retry_after_s": 3, "scorefn.admission.predicted_wait_s": 2.5,
        "scorefn.admission.predicted_device_s": 0.1}
    assert span.attributes["scorefn.error.code"] == "rate_limit_exceeded"
    assert span.status.status_code == StatusCode.UNSET  # a 4xx is the client's, not the server span's error


def test_a_failed_request_is_an_error_span(face, settings, engine, spans):
    engine.fail_with = EngineFault("the device batch failed")
    with serve(face, settings, engine) as client:
        assert client.post("/v1/score", json=score_body()).status == 500
    span = server_span(spans)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "500" and span.attributes["scorefn.error.code"] == "internal_error"


def test_an_unrouted_request_has_a_span_without_a_route(face, settings, engine, spans):
    with serve(face, settings, engine) as client:
        assert client.post("/v1/nowhere", json={}).status == 404
    span = server_span(spans)
    assert span.name == "POST" and "http.route" not in span.attributes
    assert span.attributes["scorefn.error.code"] == "not_found"


def test_log_lines_written_for_a_request_carry_its_trace(face, settings, engine, spans):
    line = access_line(face, settings, engine, TRACEPARENT)
    span = server_span(spans)
    assert line["trace_id"] == TRACE_ID and line["span_id"] == format(span.context.span_id, "016x")
    assert line["logging.googleapis.com/trace"] == f"projects/my-project/traces/{TRACE_ID}"
    assert line["logging.googleapis.com/spanId"] == line["span_id"]
    assert line["logging.googleapis.com/trace_sampled"] is True


def test_with_tracing_off_nothing_is_traced_and_log_lines_have_no_trace(face, settings, engine):
    assert tracing.tracer is None
    line = access_line(face, settings, engine, TRACEPARENT)
    assert "trace_id" not in line and not any(key.startswith("logging.googleapis.com") for key in line)


def test_a_sampled_out_request_records_nothing_but_its_log_lines_keep_the_trace(face, settings, engine, spans):
    line = access_line(face, settings, engine, f"00-{TRACE_ID}-{PARENT_ID}-00")  # the caller did not sample it
    assert spans.get_finished_spans() == ()
    assert line["trace_id"] == TRACE_ID and line["logging.googleapis.com/trace_sampled"] is False


def access_line(face, settings, engine, traceparent: str) -> dict:
    """The access log line of one /v1/score request sent with this traceparent, as the JSON formatter writes it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLineFormatter())
    access = logging.getLogger("scorefn.access")
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        with serve(face, settings, engine) as client:
            assert client.post("/v1/score", json=score_body(), headers={"traceparent": traceparent}).status == 200
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines() if '"/v1/score"' in text]
    return line


# ---- with the real engine (a stub scorer): admission, queue and device round spans ---------------------------


class GatedScorer(TokenCountCost):
    """Scores -sequence length per label; dispatch() waits for `gate` and fails while `fail` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def dispatch(self, jobs):
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if self.fail:
            raise RuntimeError("device lost")
        return [np.full((len(job.sequences), len(job.label_ids)), -1.0, np.float32) for job in jobs]

    @staticmethod
    def collect(results):
        return results


@pytest.fixture
def real() -> Iterator[tuple[AsgiClient, Engine, GatedScorer]]:
    engine = Engine(make_settings(batch_wait_ms=0.0, max_wait_s=2.0, max_round_s=0.5))
    engine.vocab_size = 1000
    scorer = GatedScorer()
    engine.start_with(scorer, ServiceModel(0.0, dict.fromkeys(KINDS, 1 / 16)))  # rounds of up to 8 tokens
    try:
        with TestClient(create_app(engine.settings, engine)) as test_client:
            yield AsgiClient(test_client), engine, scorer
    finally:
        scorer.gate.set()
        engine.stop(5)


TOKENS = {"query": [1, 2], "items": [[3], [4]], "label_token_ids": [5]}


def test_the_engine_adds_admission_queue_and_round_spans_under_the_request(real, spans):
    client, engine, _ = real
    assert client.post("/v1/score", json=TOKENS, headers={"traceparent": TRACEPARENT}).status == 200
    span = server_span(spans)
    steps = children(spans, span)
    assert set(steps) == {"validate", "admission", "queue", "device round", "encode"}
    admission = steps["admission"].attributes
    assert admission["scorefn.admission.decision"] == "admitted"
    assert admission["scorefn.admission.predicted_device_s"] == pytest.approx(6 / 16)  # 6 tokens
    assert span.attributes["scorefn.admission.decision"] == "admitted"
    joined = steps["device round"]
    assert joined.attributes["scorefn.round.request_rows"] == 2
    assert joined.attributes["scorefn.round.padded_tokens"] == 6
    assert steps["queue"].attributes["scorefn.round.id"] == joined.attributes["scorefn.round.id"]
    (round,) = [s for s in by_name(spans)["device round"] if s.parent is None]  # the round's own trace
    assert round.context.trace_id != span.context.trace_id
    assert [link.context.span_id for link in round.links] == [span.context.span_id]
    assert [link.context.span_id for link in joined.links] == [round.context.span_id]
    assert round.attributes["scorefn.round.requests"] == 1 and round.attributes["scorefn.round.rows"] == 2


def test_a_round_links_every_request_it_served(real, spans):
    client, engine, scorer = real
    scorer.gate.clear()
    futures = []
    for sequence in ([1, 2], [4], [6]):  # the first one holds the device: the next two share a round
        with tracing.tracer.start_as_current_span("client"):  # submitted under a span, as the handler does
            futures.append(engine.submit([sequence], [3]))
        assert scorer.entered.wait(WAIT_S)
    scorer.gate.set()
    for future in futures:
        future.result(WAIT_S)
    rounds = [s for s in by_name(spans)["device round"] if s.parent is None]
    assert sorted(len(r.links) for r in rounds) == [1, 2]
    engine.submit([[8]], [3]).result(WAIT_S)  # submitted under no span: not traced
    assert len([s for s in by_name(spans)["device round"] if s.parent is None]) == 2


def test_a_refused_request_has_the_admission_span_with_its_prediction(real, spans):
    client, engine, scorer = real
    scorer.gate.clear()
    blocker = engine.submit([[1] * 80], [3])  # 5 s on the device: a small request would wait past SCOREFN_MAX_WAIT_S
    assert scorer.entered.wait(WAIT_S)
    reply = client.post("/v1/score", json={"query": [1] * 3, "items": [[2]], "label_token_ids": [5]})
    scorer.gate.set()
    blocker.result(WAIT_S)
    assert reply.status == 429
    span = server_span(spans)
    admission = children(spans, span)["admission"]
    assert admission.status.status_code == StatusCode.ERROR
    assert admission.attributes["scorefn.admission.decision"] == "refused"
    assert admission.attributes["scorefn.admission.reason"] == "wait"
    assert admission.attributes["scorefn.admission.predicted_wait_s"] > 0.5
    assert span.attributes["scorefn.admission.reason"] == "wait"


def test_a_failed_round_is_an_error_on_the_round_and_the_request(real, spans):
    client, engine, scorer = real
    scorer.fail = True
    assert client.post("/v1/score", json=TOKENS).status == 500
    span = server_span(spans)
    joined = children(spans, span)["device round"]
    (round,) = [s for s in by_name(spans)["device round"] if s.parent is None]
    assert span.status.status_code == joined.status.status_code == round.status.status_code == StatusCode.ERROR
    assert [event.name for event in round.events] == ["exception"]
