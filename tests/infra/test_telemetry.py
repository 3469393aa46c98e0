"""The deploys' telemetry: Cloud Run's collector sidecar (Terraform, otel-collector.yaml) and GKE's tracing component
agree with what scorefn exports (OTLP over HTTP, /metrics on its port) and with what runtime.tracing reads."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from runtime import tracing
from tests.infra.conftest import INFRA, block, container, default, dynamic_blocks, env_of, one, run
from tests.infra.test_terraform import resolve, scorefn_container, service

OTLP_HTTP_PORT = 4318  # the OTLP/HTTP port: scorefn ships no gRPC exporter (runtime.tracing.PROTOCOL)


def _resolved(values: dict[str, Any], module: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name, value in values.items():
        if isinstance(value, str) and (match := re.fullmatch(r"\$\{tostring\((var\.\w+)\)\}", value)):
            value = "${" + match.group(1) + "}"
        out[name] = str(resolve(value, module))
    return out


def collector_config(cloudrun: dict[str, Any]) -> dict[str, Any]:
    """otel-collector.yaml as the module renders it (its placeholders filled from the locals and defaults)."""
    text = (INFRA / "cloudrun" / "otel-collector.yaml").read_text()
    values = _resolved(cloudrun["locals"]["collector_config_vars"], cloudrun)
    rendered = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)
    return yaml.safe_load(rendered)


def test_cloud_run_telemetry_is_off_unless_asked_for(cloudrun: dict[str, Any]) -> None:
    assert default(cloudrun, "telemetry_collector") is False
    assert cloudrun["locals"]["use_collector"] == "${var.telemetry_collector}"
    assert cloudrun["locals"]["tracing_env"] == "${local.use_collector ? local.tracing_env_vars : {}}"
    (sidecar,) = dynamic_blocks(block(service(cloudrun), "template"), "containers")
    assert sidecar["for_each"] == '${local.use_collector ? ["otel-collector"] : []}'
    env_blocks = dynamic_blocks(scorefn_container(cloudrun), "env")
    assert any(entry["for_each"] == "${local.tracing_env}" for entry in env_blocks)


def test_cloud_runs_tracing_variables_turn_scorefn_tracing_on_towards_the_sidecar(cloudrun: dict[str, Any]) -> None:
    variables = dict(cloudrun["locals"]["tracing_env_vars"])
    assert variables.pop("GOOGLE_CLOUD_PROJECT") == "${var.project_id}"  # log lines link to the project's traces
    env = _resolved(variables, cloudrun)
    assert tracing.wanted(env)
    assert tracing._exporters(env)  # an OTLP/HTTP exporter, no TracingError
    receiver = collector_config(cloudrun)["receivers"]["otlp"]["protocols"]
    assert set(receiver) == {"http"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{receiver['http']['endpoint']}"
    assert receiver["http"]["endpoint"].endswith(f":{OTLP_HTTP_PORT}")
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert 0 <= float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1


def test_the_sidecar_scrapes_scorefns_metrics_and_exports_to_cloud_trace_and_managed_prometheus(
        cloudrun: dict[str, Any], served_get_routes: set[str]) -> None:
    config = collector_config(cloudrun)
    (scrape,) = config["receivers"]["prometheus"]["config"]["scrape_configs"]
    assert scrape["metrics_path"] in served_get_routes
    assert scrape["static_configs"] == [{"targets": [f"localhost:{cloudrun['locals']['container_port']}"]}]
    pipelines = config["service"]["pipelines"]
    assert pipelines["traces"]["receivers"] == ["otlp"] and pipelines["traces"]["exporters"] == ["googlecloud"]
    assert pipelines["metrics"]["receivers"] == ["prometheus"]
    assert pipelines["metrics"]["exporters"] == ["googlemanagedprometheus"]
    for pipeline in pipelines.values():  # every component a pipeline names is configured
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(config[kind])
    sidecar = dynamic_blocks(block(service(cloudrun), "template"), "containers")[0]["content"]
    probe = block(block(sidecar, "startup_probe"), "http_get")
    assert resolve(probe["port"], cloudrun) == cloudrun["locals"]["collector_health_port"]
    assert config["extensions"]["health_check"]["endpoint"].endswith(f":{cloudrun['locals']['collector_health_port']}")
    assert block(sidecar, "volume_mounts")["mount_path"] == "${local.collector_config_path}"
    assert sidecar["args"] == ["--config=${local.collector_config_path}/config.yaml"]


def test_the_gke_tracing_component_points_scorefn_at_an_otlp_http_collector(kubectl: Path, tmp_path: Path) -> None:
    k8s = tmp_path / "k8s"
    shutil.copytree(INFRA / "k8s", k8s)
    traced = k8s / "overlays" / "traced"
    traced.mkdir()
    (traced / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../tpu\ncomponents:\n  - ../../components/tracing\n")
    result = run([kubectl, "kustomize", traced])
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    env = env_of(container(one(docs, "Deployment")))
    assert tracing.wanted(env) and tracing._exporters(env)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(f":{OTLP_HTTP_PORT}")
    assert env["SCOREFN_DRAIN_GRACE_S"]  # the base's variables are kept beside them

    import kubernetes_validate

    kubernetes_validate.validate(one(docs, "Deployment"), "1.33", strict=True)
