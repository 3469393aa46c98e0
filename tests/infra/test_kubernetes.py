"""Kubernetes overlays rendered with kustomize, validated against the Kubernetes schema offline, and
checked against what scorefn serves and against the GKE Terraform they run on."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.infra.conftest import (CONTAINERFILE, OVERLAYS, chips, container, default, env_of, load_module, one,
                                  INFRA)

# GKE versions in the supported window; the schema of the oldest is the strictest about new fields
# (preStop `sleep` needs 1.30+).
KUBERNETES_VERSIONS = ("1.32", "1.33")
# Custom resources that are not in the Kubernetes schema, checked structurally below instead.
CUSTOM_KINDS = {("monitoring.googleapis.com/v1", "PodMonitoring")}
# The embedded SmolLM2-135M (DESIGN.md): the model axis of SCOREFN_MESH must divide its heads.
EMBEDDED_HEADS, EMBEDDED_KV_HEADS = 9, 3
HPA_METRIC = re.compile(r"prometheus\.googleapis\.com\|(\w+)\|(gauge|counter)")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_match_the_kubernetes_schema(rendered: dict[str, list[dict[str, Any]]],
                                                        overlay: str, version: str) -> None:
    import kubernetes_validate

    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "PodMonitoring", "NetworkPolicy"} <= kinds
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        # strict: unknown fields are errors too (a misspelt key would otherwise be silently ignored)
        kubernetes_validate.validate(doc, version, strict=True)


def test_base_files_are_well_formed_on_their_own() -> None:
    import kubernetes_validate

    from tests.infra.conftest import load_yaml

    for path in sorted((INFRA / "k8s" / "base").glob("*.yaml")):
        doc = load_yaml(path)
        if doc["kind"] == "Kustomization" or (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        if doc["kind"] == "Deployment":
            continue  # image placeholder `scorefn` is completed by the overlays; validated rendered above
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_port_match_the_service(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                           served_get_routes: set[str], settings_defaults: dict[str, str]) -> None:
    spec = container(one(rendered[overlay], "Deployment"))
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    assert ports == {"http": int(settings_defaults["port"])} == {"http": 8080}
    assert env_of(spec).get("PORT", settings_defaults["port"]) == settings_defaults["port"]
    expected = {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    for probe, path in expected.items():
        http_get = spec[probe]["httpGet"]
        assert http_get["path"] == path and path in served_get_routes
        assert ports.get(http_get["port"], http_get["port"]) == 8080
    startup = spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "room for a start that compiles"
    service = one(rendered[overlay], "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_covers_prestop_and_drain(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                    settings_defaults: dict[str, str]) -> None:
    deployment = one(rendered[overlay], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    drain = float(env_of(spec).get("SCOREFN_DRAIN_GRACE_S", settings_defaults["drain_grace_s"]))
    pre_stop = spec["lifecycle"]["preStop"]["sleep"]["seconds"]
    # `scorefn serve` gives granian workers drain + 5 s before killing them.
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_locked_down(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    deployment = one(rendered[overlay], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    image_user = re.search(r"^USER (\d+):(\d+)$", CONTAINERFILE.read_text(), flags=re.MULTILINE)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(image_user.group(1))
    context = spec["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "writable /tmp on a read-only root"
    for key in ("cpu", "memory"):
        assert spec["resources"]["requests"][key] and spec["resources"]["limits"][key]
    assert "replicas" not in deployment["spec"], "the HPA owns replicas"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_reach_the_pods(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    assert selects(one(docs, "Deployment")["spec"]["selector"]["matchLabels"])
    assert selects(one(docs, "Service")["spec"]["selector"])
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    assert selects(one(docs, "PodMonitoring")["spec"]["selector"]["matchLabels"])
    assert selects(one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"])
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "scorefn"}
    assert all(d["metadata"].get("namespace") == "scorefn" for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_on_a_gauge_that_metrics_exports(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                                    served_get_routes: set[str],
                                                    exported_metrics: dict[str, str]) -> None:
    docs = rendered[overlay]
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    match = HPA_METRIC.fullmatch(metric["pods"]["metric"]["name"])
    assert match, "Custom Metrics Stackdriver Adapter name: prometheus.googleapis.com|<metric>|<type>"
    name, kind = match.groups()
    assert exported_metrics.get(name) == kind, (
        f"HPA scales on {name} ({kind}) but /metrics exports {sorted(exported_metrics)}")
    # ...and Managed Prometheus scrapes the endpoint that serves it.
    (endpoint,) = one(docs, "PodMonitoring")["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["path"] in served_get_routes
    ports = {p["name"] for p in container(one(docs, "Deployment"))["ports"]}
    assert endpoint["port"] in ports


def test_tpu_overlay_matches_topology_mesh_and_the_gke_node_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = one(rendered["tpu"], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    selector = pod["nodeSelector"]
    topology = selector["cloud.google.com/gke-tpu-topology"]
    requests, limits = spec["resources"]["requests"], spec["resources"]["limits"]
    assert requests["google.com/tpu"] == limits["google.com/tpu"], "extended resources: requests == limits"
    tpus = int(limits["google.com/tpu"])
    assert tpus == chips(topology), "one pod takes the whole single-host slice"
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    env = env_of(spec)
    data, model = (int(n) for n in re.fullmatch(r"(\d+)x(\d+)", env["SCOREFN_MESH"]).groups())
    assert data * model == tpus, "SCOREFN_MESH (DATAxMODEL) uses every chip"
    assert EMBEDDED_HEADS % model == 0 and EMBEDDED_KV_HEADS % model == 0, "the default image's model can split"
    batches = [int(b) for b in env["SCOREFN_BATCH_BUCKETS"].split(",")]
    assert all(b % data == 0 for b in batches), "every device batch splits evenly over the data axis"

    # The node pool of infra/gke, with its defaults, offers exactly these nodes.
    gke = load_module(INFRA / "gke")
    assert topology == default(gke, "tpu_topology")
    machine = default(gke, "tpu_machine_type")
    assert tpus == int(re.search(r"-(\d+)t$", machine).group(1))
    prefix, when_prefix, otherwise = re.search(
        r'startswith\(var\.tpu_machine_type, "([^"]+)"\) \? "([^"]+)" : "([^"]+)"',
        gke["locals"]["tpu_accelerator"]).groups()
    accelerator = when_prefix if machine.startswith(prefix) else otherwise
    assert selector["cloud.google.com/gke-tpu-accelerator"] == accelerator
    assert one(rendered["tpu"], "HorizontalPodAutoscaler")["spec"]["maxReplicas"] <= default(gke, "tpu_max_nodes")
    assert one(rendered["tpu"], "ServiceAccount")["metadata"]["name"] == default(gke, "kubernetes_service_account")
    assert deployment["metadata"]["namespace"] == default(gke, "namespace")


def test_cpu_overlay_requests_no_accelerator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = one(rendered["cpu"], "Deployment")
    spec = container(deployment)
    assert not any("tpu" in key or "gpu" in key for key in spec["resources"]["limits"])
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
    assert "SCOREFN_MESH" not in env_of(spec)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_image_is_the_matching_accelerator_build(rendered: dict[str, list[dict[str, Any]]],
                                                         overlay: str) -> None:
    image = container(one(rendered[overlay], "Deployment"))["image"]
    assert image.endswith(f"/scorefn:{overlay}"), image
