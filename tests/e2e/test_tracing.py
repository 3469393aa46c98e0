"""A real server with tracing on exports its spans over OTLP/HTTP to a small receiver in the test: the request's
span continues the trace id sent in `traceparent`, the engine's spans join it, the start is a trace of its own,
and the access log line carries the trace's ids in Cloud Logging's fields."""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import urllib.request
from collections.abc import Callable

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess

pytestmark = pytest.mark.slow
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
WAIT_S = 60.0


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port: every span it is sent, as (resource attributes, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with receiver._changed:
                    for resource_spans in request.resource_spans:
                        resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans += [(resource, span) for span in scope_spans.spans]
                    receiver._changed.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def wait_for(self, done: Callable[[list], bool], timeout: float = WAIT_S) -> list:
        with self._changed:
            if not self._changed.wait_for(lambda: done([span for _, span in self.spans]), timeout):
                pytest.fail(f"spans received: {[span.name for _, span in self.spans]}")
            return [span for _, span in self.spans]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def named(spans: list, trace_id: str) -> dict[str, object]:
    return {span.name: span for span in spans if span.trace_id.hex() == trace_id}


def test_the_server_exports_spans_that_continue_the_trace_sent_in_traceparent():
    receiver = Receiver()
    env = {**SMALL_BUCKETS, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "scorefn-e2e", "GOOGLE_CLOUD_PROJECT": "my-project"}
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
            spans = receiver.wait_for(lambda spans: wanted <= set(named(spans, TRACE_ID)))
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
