"""`scorefn batch` deployed as code: the Cloud Run Job (infra/cloudrun/job.tf) and the Kubernetes Indexed Job
(infra/k8s/batch), checked offline against the batch command's own arguments and the service's deploys."""

from __future__ import annotations

from typing import Any

import pytest

from handler.batch.cli import _run_parser
from tests.infra.conftest import OVERLAYS, block, container, default, one
from tests.infra.test_kubernetes import KUBERNETES_VERSIONS


def cloud_run_job(cloudrun: dict[str, Any]) -> dict[str, Any]:
    return cloudrun["resource"]["google_cloud_run_v2_job"]["batch"]


def test_cloud_run_job_runs_scorefn_batch_on_an_l4_per_task_with_the_bucket_mounted(cloudrun: dict[str, Any]) -> None:
    job = cloud_run_job(cloudrun)
    assert job["count"] == "${local.use_batch ? 1 : 0}" and default(cloudrun, "batch_bucket") == ""
    execution = block(job, "template")
    assert execution["task_count"] == "${var.batch_task_count}"
    assert execution["parallelism"] == "${var.batch_parallelism}"
    task = block(execution, "template")
    assert block(task, "node_selector")["accelerator"] == "nvidia-l4"
    (spec,) = task["containers"]
    assert spec["resources"][0]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["command"] == ["scorefn"] and spec["args"][0] == "batch"
    args = _run_parser().parse_args(spec["args"][1:])  # the command line parses as `scorefn batch` reads it
    mount = next(m for m in spec["volume_mounts"] if m["name"] == "data")["mount_path"]
    assert mount == "${local.batch_mount}" and cloudrun["locals"]["batch_mount"] == "/data"
    assert str(args.input).startswith(mount) and str(args.output).startswith(mount)
    assert args.shard is None and args.shards is None  # the shard comes from CLOUD_RUN_TASK_INDEX / _COUNT
    data = next(v for v in task["volumes"] if v["name"] == "data")
    assert block(data, "gcs") == {"bucket": "${var.batch_bucket}", "read_only": False}


def test_cloud_run_job_may_only_use_objects_of_its_bucket(cloudrun: dict[str, Any]) -> None:
    grant = cloudrun["resource"]["google_storage_bucket_iam_member"]["batch_user"]
    assert grant["bucket"] == "${var.batch_bucket}" and grant["role"] == "roles/storage.objectUser"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_batch_job_matches_the_kubernetes_schema(rendered_batch: dict[str, list[dict[str, Any]]], overlay: str,
                                                 version: str) -> None:
    import kubernetes_validate

    docs = rendered_batch[overlay]
    assert {d["kind"] for d in docs} == {"Job", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_indexed_job_has_one_shard_per_completion(rendered_batch: dict[str, list[dict[str, Any]]],
                                                  overlay: str) -> None:
    job = one(rendered_batch[overlay], "Job", "scorefn-batch")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
    batch = container(job, "scorefn-batch")
    assert batch["command"] == ["scorefn"] and batch["args"][0] == "batch"
    args = _run_parser().parse_args(batch["args"][1:])
    assert args.shards == spec["completions"] >= spec["parallelism"]  # JOB_COMPLETION_INDEX < --shards, each once
    mounts = {m["name"]: m["mountPath"] for m in batch["volumeMounts"]}
    assert str(args.input).startswith(mounts["data"] + "/") and str(args.output).startswith(mounts["data"] + "/")
    volume = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert job["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"


def test_tpu_batch_pods_take_a_slice_as_the_service_pods_do(rendered: dict[str, list[dict[str, Any]]],
                                                            rendered_batch: dict[str, list[dict[str, Any]]]) -> None:
    service = one(rendered["tpu"], "Deployment")["spec"]["template"]["spec"]
    batch = one(rendered_batch["tpu"], "Job", "scorefn-batch")["spec"]["template"]["spec"]
    assert batch["nodeSelector"] == service["nodeSelector"] and batch["tolerations"] == service["tolerations"]
    served, batched = service["containers"][0], batch["containers"][0]
    assert batched["resources"] == served["resources"]
    mesh = {e["name"]: e["value"] for e in served["env"] if e["name"] in ("SCOREFN_MESH", "SCOREFN_BATCH_BUCKETS")}
    assert len(mesh) == 2
    assert mesh.items() <= {e["name"]: e.get("value") for e in batched["env"]}.items()
