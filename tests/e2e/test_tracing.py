"""A real server with tracing on exports its spans over OTLP/HTTP to a small receiver in the test: the request's
span continues the trace id sent in `traceparent`, the engine's spans join it, the start is a trace of its own,
and the access log line carries the trace's ids in Cloud Logging's fields."""

from __future__ import annotations

import json
import urllib.request

import pytest

from runtime.shapes.programs import PROGRAMS
from runtime.tools.otlp_receiver import OtlpReceiver
from runtime.tools.serverproc import ServerProcess
from tests.e2e.conftest import FUNCTIONAL

pytestmark = pytest.mark.slow
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
WAIT_S = 60.0


def named(spans: list, trace_id: str) -> dict[str, object]:
    return {span.name: span for span in spans if span.trace_id.hex() == trace_id}


def test_the_server_exports_spans_that_continue_the_trace_sent_in_traceparent(tiny_llama_dir):
    # A tiny model: the spans, not the scores, are what is shown.
    receiver = OtlpReceiver()
    env = {**FUNCTIONAL, "SCOREFN_MODEL": str(tiny_llama_dir), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
           "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "scorefn-e2e", "GOOGLE_CLOUD_PROJECT": "my-project"}
    try:
        with ServerProcess(env=env) as server:
            request = urllib.request.Request(
                server.url + "/v1/score", method="POST", headers={
                    "content-type": "application/json", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                data=json.dumps({"query": "The capital of France is", "items": [" Paris", " Rome"],
                                 "label_token_ids": [1, 2]}).encode())
            with urllib.request.urlopen(request, timeout=WAIT_S) as response:
                assert response.status == 200
            wanted = {"POST /v1/score", "validate", "tokenize", "admission", "queue", "device round", "encode"}
            spans = receiver.wait_for(lambda spans: wanted <= set(named(spans, TRACE_ID)), WAIT_S)
            assert spans is not None, f"spans received: {[span.name for _, span in receiver.spans]}"
            access = _access_line(server, "/v1/score")
    finally:
        receiver.close()
    request_spans = named(spans, TRACE_ID)
    root = request_spans["POST /v1/score"]
    assert root.parent_span_id.hex() == PARENT_ID
    assert all(request_spans[name].parent_span_id == root.span_id for name in wanted - {"POST /v1/score", "tokenize"})
    assert request_spans["tokenize"].parent_span_id == request_spans["validate"].span_id
    # The device round is a trace of its own, linked to the request.
    (round,) = [span for span in spans if span.name == "device round" and not span.parent_span_id]
    assert [link.span_id for link in round.links] == [root.span_id]
    joined = request_spans["device round"]
    assert [link.span_id for link in joined.links] == [round.span_id]
    attributes = {kv.key: kv.value for kv in joined.attributes}
    buckets = [value.string_value for value in attributes["scorefn.round.buckets"].array_value.values]
    assert buckets and {bucket.partition("[")[0] for bucket in buckets} <= set(PROGRAMS)  # e.g. hidden[4, 32]
    # The start: a trace of its own, a span per phase.
    (start,) = [span for span in spans if span.name == "start"]
    phases = [span.name for span in spans if span.parent_span_id == start.span_id]
    assert sorted(phases) == ["boot", "calibrate", "compile", "import", "load"]
    resources = {resource.get("service.name") for resource, _ in receiver.spans}
    assert resources == {"scorefn-e2e"}
    # The access log line is tied to the request's span.
    assert access["trace_id"] == TRACE_ID and access["span_id"] == root.span_id.hex()
    assert access["logging.googleapis.com/trace"] == f"projects/my-project/traces/{TRACE_ID}"


def _access_line(server: ServerProcess, path: str) -> dict:
    """The access log line of the request to `path`."""
    line = server.wait_for_line(lambda line: f'"path": "{path}"' in line, WAIT_S)
    assert line is not None, f"no access log line for {path}"
    return json.loads(line)
