"""Traces: OpenTelemetry's SDK, set up from the standard OTEL_* variables, or nothing at all.

Tracing is on when OTEL_TRACES_EXPORTER names an exporter (`otlp`, `console`) or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), unless OTEL_SDK_DISABLED=true. Everything
else is the SDK's own reading of the standard variables: the exporter's endpoint, headers and timeout
(OTEL_EXPORTER_OTLP_*), the sampler (OTEL_TRACES_SAMPLER, default parentbased_always_on), the batching
(OTEL_BSP_*), the resource (OTEL_SERVICE_NAME, default K_SERVICE on Cloud Run, else "scorefn";
OTEL_RESOURCE_ATTRIBUTES). OTLP goes over HTTP/protobuf only (gRPC's exporter would add grpcio to the image).

Off, `tracer` is None, no OpenTelemetry module is imported, and each place that would trace reads that one
attribute. Who traces what: handler.tracing (a span per HTTP request), runtime.requests.spans (admission, queue,
device rounds) and the engine's start (runtime.engine). Log lines carry the current span's ids
(log_fields), and on Google Cloud the fields Cloud Logging links to Cloud Trace with: the project comes from
GOOGLE_CLOUD_PROJECT, else on Cloud Run and GKE from the metadata server. Pure Python, imported by both.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from runtime.interface import Prediction, QueueFull

log = logging.getLogger("scorefn.runtime")

tracer: Any = None  # an opentelemetry Tracer while tracing is on
cloud_project: str | None = None  # the Google Cloud project whose Cloud Trace holds the traces
_provider: Any = None
_METADATA_PROJECT = "http://metadata.google.internal/computeMetadata/v1/project/project-id"
_METADATA_TIMEOUT_S = 1.0
EXPORTERS = ("otlp", "console", "none")
PROTOCOL = "http/protobuf"


class TracingError(ValueError):
    """An OTEL_* variable asks for what scorefn cannot do (the start fails, naming it)."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(name not in ("", "none") for name in _names(exporters))
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Install the SDK's tracer provider when the OTEL_* variables ask for traces (the served apps call it once, as
    their start begins); whether tracing is on. TracingError: a variable asks for an exporter or protocol that is
    not shipped."""
    environ = os.environ if environ is None else environ
    if tracer is not None or not wanted(environ):
        return tracer is not None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(environ))
    for exporter in _exporters(environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    use(provider, environ.get("GOOGLE_CLOUD_PROJECT") or _metadata_project(environ))
    return True


def use(provider: Any, project: str | None = None) -> None:
    """Trace to this SDK TracerProvider from now on (tests pass one with an in-memory exporter), in this Google Cloud
    project's Cloud Trace (None: log lines carry the ids only); None: stop."""
    global tracer, _provider, cloud_project
    _provider, cloud_project = provider, project
    tracer = None if provider is None else provider.get_tracer("scorefn", _version())


def log_fields() -> dict[str, Any]:
    """The current span's ids for a log line (handler.logs): trace_id and span_id, and in a Google Cloud project
    Cloud Logging's trace fields; nothing while tracing is off or no span is current."""
    if tracer is None:
        return {}
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    trace_id, span_id = format(context.trace_id, "032x"), format(context.span_id, "016x")
    fields: dict[str, Any] = {"trace_id": trace_id, "span_id": span_id}
    if cloud_project:
        fields.update({"logging.googleapis.com/trace": f"projects/{cloud_project}/traces/{trace_id}",
                       "logging.googleapis.com/spanId": span_id,
                       "logging.googleapis.com/trace_sampled": context.trace_flags.sampled})
    return fields


def admission_attributes(predicted: Prediction | None, refusal: Exception | None = None) -> dict[str, Any]:
    """A request's scorefn.admission.* attributes: admitted or refused (then why, and its Retry-After), and what
    admission predicted (a QueueFull carries its own prediction)."""
    attributes: dict[str, Any] = {"scorefn.admission.decision": "admitted" if refusal is None else "refused"}
    if isinstance(refusal, QueueFull):
        attributes.update({"scorefn.admission.reason": refusal.reason,
                           "scorefn.admission.retry_after_s": refusal.retry_after_s})
        predicted = refusal.predicted
    elif refusal is not None:
        attributes["scorefn.admission.reason"] = type(refusal).__name__
    if predicted is not None:
        attributes.update({"scorefn.admission.predicted_wait_s": predicted.queue_seconds,
                           "scorefn.admission.predicted_device_s": predicted.device_seconds})
    return attributes


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans still batched (the drain calls it: a stopping instance keeps its last requests' spans)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def epoch_ns(reading: float, clock: Callable[[], float] = time.monotonic) -> int:
    """A reading of `clock` (time.monotonic, time.perf_counter) as the wall-clock nanoseconds spans are stamped
    with."""
    return time.time_ns() - int((clock() - reading) * 1e9)


def _metadata_project(environ: Mapping[str, str]) -> str | None:
    """On Cloud Run (a service's K_SERVICE, a job's CLOUD_RUN_JOB) or Kubernetes (GKE), the project the metadata
    server names."""
    if not any(environ.get(name) for name in ("K_SERVICE", "CLOUD_RUN_JOB", "KUBERNETES_SERVICE_HOST")):
        return None
    request = urllib.request.Request(_METADATA_PROJECT, headers={"Metadata-Flavor": "Google"})
    try:
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the metadata server is local
        with no_proxy.open(request, timeout=_METADATA_TIMEOUT_S) as response:
            return response.read().decode().strip() or None
    except OSError as error:
        log.warning("no Google Cloud project for log lines' trace links (set GOOGLE_CLOUD_PROJECT): the metadata "
                    "server did not answer: %s", error)
        return None


def _names(value: str) -> list[str]:
    return [name.strip().lower() for name in value.split(",")]


def _exporters(environ: Mapping[str, str]) -> list[Any]:
    exporters = []
    for name in _names(environ.get("OTEL_TRACES_EXPORTER", "otlp")):
        if name == "otlp":
            protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            if (protocol or PROTOCOL).strip().lower() != PROTOCOL:
                raise TracingError(f"OTLP protocol {protocol!r} is not shipped: scorefn exports OTLP over {PROTOCOL} "
                                   "(set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and the collector's HTTP port, "
                                   "usually 4318)")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name not in ("", "none"):
            raise TracingError(f"OTEL_TRACES_EXPORTER names {name!r}: scorefn exports traces with "
                               f"{', '.join(EXPORTERS)}")
    return exporters


def _resource(environ: Mapping[str, str]) -> Any:
    """The SDK's resource from OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, named after the Cloud Run service
    (K_SERVICE) or "scorefn" when they name no service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource

    resource = Resource({SERVICE_VERSION: _version()}).merge(Resource.create())  # the variables win
    if str(resource.attributes[SERVICE_NAME]).startswith("unknown_service"):  # the SDK's stand-in: they name none
        resource = resource.merge(Resource({SERVICE_NAME: environ.get("K_SERVICE") or "scorefn"}))
    return resource


def _version() -> str:
    try:
        return importlib.metadata.version("scorefn")
    except importlib.metadata.PackageNotFoundError:
        return "0"
