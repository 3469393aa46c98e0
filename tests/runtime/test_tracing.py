"""runtime.tracing: the OTEL_* variables turn tracing on or leave it off, name what is shipped, and the resource
is named after the service."""

from __future__ import annotations

import http.server
import threading

import pytest

from runtime import tracing


@pytest.fixture(autouse=True)
def tracing_off():
    yield
    provider = tracing._provider
    tracing.use(None)
    if provider is not None:
        provider.shutdown()


@pytest.mark.parametrize("environ, wanted", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
])
def test_the_otel_variables_say_whether_to_trace(environ, wanted):
    assert tracing.wanted(environ) is wanted
    assert tracing.configure(environ) is wanted
    assert (tracing.tracer is not None) is wanted


@pytest.mark.parametrize("environ, named", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "'zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "'grpc'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "'grpc'"),
])
def test_what_is_not_shipped_fails_the_start_naming_it(environ, named):
    with pytest.raises(tracing.TracingError, match=named):
        tracing.configure(environ)
    assert tracing.tracer is None


def test_the_resource_is_named_after_the_cloud_run_service_unless_otel_names_one(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert tracing._resource({}).attributes["service.name"] == "scorefn"
    assert tracing._resource({"K_SERVICE": "ranker"}).attributes["service.name"] == "ranker"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes,deployment.environment=prod")
    resource = tracing._resource({"K_SERVICE": "ranker"})
    assert resource.attributes["service.name"] == "from-attributes"
    assert resource.attributes["deployment.environment"] == "prod"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "judge")
    assert tracing._resource({"K_SERVICE": "ranker"}).attributes["service.name"] == "judge"
    assert tracing._resource({}).attributes["service.version"]


def test_the_google_cloud_project_comes_from_the_environment_off_cloud_run():
    assert tracing.configure({"OTEL_TRACES_EXPORTER": "console", "GOOGLE_CLOUD_PROJECT": "p-1"})
    assert tracing.cloud_project == "p-1"


def test_log_fields_are_empty_without_a_current_span():
    assert tracing.log_fields() == {}
    assert tracing.configure({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing.log_fields() == {}
    with tracing.tracer.start_as_current_span("work") as span:
        fields = tracing.log_fields()
    assert fields == {"trace_id": format(span.get_span_context().trace_id, "032x"),
                      "span_id": format(span.get_span_context().span_id, "016x")}


def test_on_cloud_run_the_project_comes_from_the_metadata_server(monkeypatch):
    asked = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append((self.path, self.headers.get("metadata-flavor")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"proj-x")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.handle_request, daemon=True).start()
    monkeypatch.setattr(tracing, "_METADATA_PROJECT", f"http://127.0.0.1:{server.server_address[1]}/project-id")
    try:
        assert tracing.configure({"OTEL_TRACES_EXPORTER": "console", "K_SERVICE": "ranker"})
    finally:
        server.server_close()
    assert tracing.cloud_project == "proj-x" and asked == [("/project-id", "Google")]
