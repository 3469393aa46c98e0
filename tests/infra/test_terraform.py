"""Terraform parsed with python-hcl2: Cloud Run (L4) and GKE (TPU) agree with what scorefn serves."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from tests.infra.conftest import INFRA, block, default, dynamic_blocks, load_module

MODULES = ("cloudrun", "gke")
# Roles a runtime or node identity may hold; anything broader (owner, editor, *.admin) fails.
ALLOWED_ROLES = {
    "roles/logging.logWriter", "roles/monitoring.metricWriter", "roles/monitoring.viewer",
    "roles/artifactregistry.reader", "roles/storage.objectViewer", "roles/storage.objectUser",
    "roles/secretmanager.secretAccessor", "roles/run.invoker", "roles/container.defaultNodeServiceAccount",
    "roles/cloudtrace.agent",
}
CLOUD_RUN_SIGKILL_AFTER_S = 10  # Cloud Run kills an instance this long after SIGTERM


@pytest.fixture(scope="module", params=MODULES)
def module(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_module(INFRA / request.param)


def service(cloudrun: dict[str, Any]) -> dict[str, Any]:
    return cloudrun["resource"]["google_cloud_run_v2_service"]["scorefn"]


def scorefn_container(cloudrun: dict[str, Any]) -> dict[str, Any]:
    containers = block(service(cloudrun), "template")["containers"]
    assert len(containers) == 1
    return containers[0]


def resolve(value: Any, module: dict[str, Any]) -> Any:
    """A literal, or "${local.x}"/"${var.x}" resolved one level (to the local's value / the variable's default)."""
    if isinstance(value, str):
        match = re.fullmatch(r"\$\{(local|var)\.(\w+)\}", value)
        if match:
            kind, name = match.groups()
            return module["locals"][name] if kind == "local" else default(module, name)
    return value


# ---------------------------------------------------------------- both modules

def test_providers_pinned_with_upper_bound(module: dict[str, Any]) -> None:
    (terraform,) = module["terraform"]
    assert terraform["required_version"]
    google = terraform["required_providers"][0]["google"]
    assert google["source"] == "hashicorp/google"
    assert re.search(r">=\s*[\d.]+", google["version"]) and re.search(r"<\s*[\d.]+", google["version"])


def test_every_variable_is_documented(module: dict[str, Any]) -> None:
    for name, body in module["variable"].items():
        assert body.get("description", "").strip(), f"variable {name} has no description"
        assert "type" in body, f"variable {name} has no type"
    required = {name for name, body in module["variable"].items() if "default" not in body}
    assert required == {"project_id"}, "only the project has no sane default"


def test_iam_is_least_privilege(module: dict[str, Any]) -> None:
    # Every role the module mentions anywhere (iam members, for_each lists, locals).
    roles = set(re.findall(r"roles/[\w.]+", str(module)))
    assert roles, "the module grants its identities something"
    assert roles <= ALLOWED_ROLES, f"roles beyond what scorefn needs: {roles - ALLOWED_ROLES}"
    assert not any(kind in module["resource"] for kind in ("google_project_iam_binding", "google_project_iam_policy"))


# ---------------------------------------------------------------- Cloud Run

def test_cloud_run_gpu_is_an_l4_with_enough_cpu_and_memory(cloudrun: dict[str, Any]) -> None:
    template = block(service(cloudrun), "template")
    assert block(template, "node_selector")["accelerator"] == "nvidia-l4"
    assert resolve(template["gpu_zonal_redundancy_disabled"], cloudrun) in (True, False)
    resources = block(scorefn_container(cloudrun), "resources")
    limits = resources["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert float(resolve(limits["cpu"], cloudrun)) >= 4
    memory = resolve(limits["memory"], cloudrun)
    assert memory.endswith("Gi") and int(memory[:-2]) >= 16
    assert resources["startup_cpu_boost"] is True
    assert resources["cpu_idle"] is False, "GPU services need instance-based billing"
    assert template["execution_environment"] == "EXECUTION_ENVIRONMENT_GEN2"


def test_cloud_run_probes_and_port_match_the_service(cloudrun: dict[str, Any], served_get_routes: set[str],
                                                     settings_defaults: dict[str, str]) -> None:
    container = scorefn_container(cloudrun)
    port = resolve(block(container, "ports")["container_port"], cloudrun)
    assert port == int(settings_defaults["port"]) == 8080
    startup = block(container, "startup_probe")
    liveness = block(container, "liveness_probe")
    assert block(startup, "http_get")["path"] == "/ready"
    assert block(liveness, "http_get")["path"] == "/health"
    for probe in (startup, liveness):
        http_get = block(probe, "http_get")
        assert http_get["path"] in served_get_routes
        assert resolve(http_get["port"], cloudrun) == port
    # Generous but within Cloud Run's startup window (failure_threshold x period <= 600 s).
    window = resolve(startup["failure_threshold"], cloudrun) * startup["period_seconds"]
    assert 120 <= window <= 600


def test_cloud_run_drains_before_it_is_killed(cloudrun: dict[str, Any], settings_defaults: dict[str, str]) -> None:
    env = {e["name"]: e["value"] for e in scorefn_container(cloudrun)["env"]}
    grace = float(env["SCOREFN_DRAIN_GRACE_S"])
    assert grace < CLOUD_RUN_SIGKILL_AFTER_S
    assert float(settings_defaults["drain_grace_s"]) >= grace, "lowered from the default for Cloud Run"
    assert "PORT" not in env, "Cloud Run sets PORT itself"


def test_cloud_run_scaling_knobs_are_variables(cloudrun: dict[str, Any]) -> None:
    template = block(service(cloudrun), "template")
    scaling = block(template, "scaling")
    assert scaling["min_instance_count"] == "${var.min_instances}"
    assert scaling["max_instance_count"] == "${var.max_instances}"
    assert default(cloudrun, "min_instances") == 0
    assert default(cloudrun, "max_instances") >= 1


def test_cloud_run_concurrency_is_what_an_instance_answers_within_the_wait_budget(
        cloudrun: dict[str, Any], settings_defaults: dict[str, str]) -> None:
    template = block(service(cloudrun), "template")
    assert template["max_instance_request_concurrency"] == "${local.max_instance_request_concurrency}"
    # Little's law: throughput x the wait budget, unless set explicitly; within Cloud Run's 1..1000.
    assert cloudrun["locals"]["max_instance_request_concurrency"] == (
        "${coalesce(var.max_instance_request_concurrency, "
        "min(1000, max(1, ceil(var.requests_per_second * var.max_wait_s))))}")
    assert default(cloudrun, "max_instance_request_concurrency") is None
    derived = min(1000, max(1, math.ceil(default(cloudrun, "requests_per_second") * default(cloudrun, "max_wait_s"))))
    from runtime.assembly.platform import DEFAULT_BUCKETS
    from runtime.requests.round_builder import MIN_WAIT_S, admission_limits

    largest_batch = max(DEFAULT_BUCKETS["accelerator"][0])  # Cloud Run runs the GPU image: the accelerator buckets
    assert derived >= largest_batch, "room to fill a device batch"
    # The instance admits by the same budget the concurrency is derived from, the setting's default unless changed.
    env = {e["name"]: e["value"] for e in scorefn_container(cloudrun)["env"]}
    assert env["SCOREFN_MAX_WAIT_S"] == "${tostring(var.max_wait_s)}"
    # The setting's auto on a GPU, whose device batch costs far less than a round (runtime.requests.round_builder)
    assert settings_defaults["max_wait_s"] == "auto"
    assert default(cloudrun, "max_wait_s") == admission_limits(None, None, per_batch_s=0.01)[0] == MIN_WAIT_S


def test_cloud_run_weights_volume_is_read_only_and_sets_the_model(cloudrun: dict[str, Any]) -> None:
    template = block(service(cloudrun), "template")
    container = scorefn_container(cloudrun)
    weights = [b for b in dynamic_blocks(template, "volumes") if "use_weights" in b["for_each"]]
    assert len(weights) == 1
    gcs = block(weights[0]["content"], "gcs")
    assert gcs["bucket"] == "${var.weights_bucket}" and gcs["read_only"] is True
    envs = [b for b in dynamic_blocks(container, "env") if "use_weights" in b["for_each"]]
    assert [b["content"]["name"] for b in envs] == ["SCOREFN_MODEL"]
    mounts = [b for b in dynamic_blocks(container, "volume_mounts") if "use_weights" in b["for_each"]]
    assert mounts and mounts[0]["content"]["mount_path"] == "${local.weights_mount}"
    assert cloudrun["locals"]["scorefn_model"].startswith("${var.weights_path")
    assert default(cloudrun, "weights_bucket") == "", "baked-in model by default"
    # Read-only access on the weights bucket, only when one is used.
    reader = cloudrun["resource"]["google_storage_bucket_iam_member"]["weights_reader"]
    assert reader["role"] == "roles/storage.objectViewer" and "use_weights" in reader["count"]


def test_cloud_run_has_registry_and_url_output(cloudrun: dict[str, Any]) -> None:
    repo = cloudrun["resource"]["google_artifact_registry_repository"]["scorefn"]
    assert repo["format"] == "DOCKER"
    assert cloudrun["output"]["url"]["value"] == "${google_cloud_run_v2_service.scorefn.uri}"
    assert service(cloudrun)["template"][0]["service_account"] == "${google_service_account.scorefn.email}"


# ---------------------------------------------------------------- GKE

def tpu_pool(gke: dict[str, Any]) -> dict[str, Any]:
    return gke["resource"]["google_container_node_pool"]["tpu"]


def test_gke_tpu_pool_autoscales_from_zero(gke: dict[str, Any]) -> None:
    autoscaling = block(tpu_pool(gke), "autoscaling")
    assert autoscaling["total_min_node_count"] == "${var.tpu_min_nodes}"
    assert default(gke, "tpu_min_nodes") == 0
    assert default(gke, "tpu_max_nodes") >= 1
    assert block(tpu_pool(gke), "node_config")["machine_type"] == "${var.tpu_machine_type}"


def test_gke_tpu_defaults_are_a_consistent_single_host_slice(gke: dict[str, Any]) -> None:
    from tests.infra.conftest import chips

    machine = default(gke, "tpu_machine_type")
    topology = default(gke, "tpu_topology")
    assert re.fullmatch(r"(ct5lp-hightpu|ct6e-standard)-[148]t", machine)
    assert chips(topology) == int(re.search(r"-(\d+)t$", machine).group(1))
    assert gke["locals"]["tpu_chips_per_node"] == '${tonumber(regex("-([0-9]+)t$", var.tpu_machine_type)[0])}'


def test_gke_workload_identity_and_managed_prometheus(gke: dict[str, Any]) -> None:
    cluster = gke["resource"]["google_container_cluster"]["scorefn"]
    assert block(cluster, "workload_identity_config")["workload_pool"] == "${local.workload_pool}"
    assert gke["locals"]["workload_pool"] == "${var.project_id}.svc.id.goog"
    assert block(block(cluster, "monitoring_config"), "managed_prometheus")["enabled"] is True
    assert cluster["remove_default_node_pool"] is True
    # Every node pool hides the node metadata from pods (the reason CKV_GCP_69 is skipped in .checkov.yaml).
    for name, pool in gke["resource"]["google_container_node_pool"].items():
        config = block(pool, "node_config")
        assert block(config, "workload_metadata_config")["mode"] == "GKE_METADATA", name
        assert block(pool, "management")["auto_repair"] is True, name


def test_gke_grants_the_metrics_adapter_read_only_monitoring(gke: dict[str, Any]) -> None:
    binding = gke["resource"]["google_project_iam_member"]["metrics_adapter_viewer"]
    assert binding["role"] == "roles/monitoring.viewer"
    assert gke["locals"]["metrics_adapter_principal"].endswith("/ns/custom-metrics/sa/custom-metrics-stackdriver-adapter")
