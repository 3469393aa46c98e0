"""A small OTLP/HTTP trace receiver on a free loopback port: what a collector would get from a server with tracing
on (the end-to-end test of traces, and the benchmark's W3 with tracing on)."""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

_REPLY = ExportTraceServiceResponse().SerializeToString()


class OtlpReceiver:
    """Receives spans on POST /v1/traces (OTEL_EXPORTER_OTLP_ENDPOINT=`url`): `spans` holds each as (its
    resource's attributes, the span's protobuf message); `decode=False` only counts the exports and their bytes
    (a benchmark's receiver: decoding would take CPU from the server it measures)."""

    def __init__(self, decode: bool = True) -> None:
        self.decode = decode
        self.exports = self.bytes = 0
        self.spans: list[tuple[dict[str, str], Any]] = []
        self._changed = threading.Condition()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()

    def wait_for(self, done: Callable[[list], bool], timeout: float) -> list | None:
        """The spans received once `done(spans)` holds; None if it still does not after `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: done([span for _, span in self.spans]), timeout):
                return None
            return [span for _, span in self.spans]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _received(self, request: ExportTraceServiceRequest) -> None:
        with self._changed:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(resource, span) for span in scope_spans.spans]
            self._changed.notify_all()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver.exports += 1
                    receiver.bytes += len(body)
                    if receiver.decode:
                        receiver._received(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(_REPLY)))
                self.end_headers()
                self.wfile.write(_REPLY)

            def log_message(self, *args: object) -> None:  # quiet: the server's own log is what matters
                pass

        return Handler
