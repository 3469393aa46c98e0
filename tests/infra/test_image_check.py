"""scripts/image_check.py runs the image as infra/k8s deploys it: the same environment, user and filesystem.

(The image check itself builds and runs containers: `make image-check`, which .ci/run runs after `make test`.)
"""

from __future__ import annotations

from scripts import image_check
from tests.infra.conftest import INFRA, container, env_of, load_yaml
from tests.infra.test_containerfile import build_args, final_stage


def deployment() -> dict:
    return load_yaml(INFRA / "k8s" / "base" / "deployment.yaml")


def test_the_check_uses_the_manifests_environment() -> None:
    env = env_of(container(deployment()))
    assert image_check.K8S_ENV == {name: env[name] for name in image_check.K8S_ENV}
    assert set(env) <= set(image_check.K8S_ENV), f"the manifest sets more: {set(env) - set(image_check.K8S_ENV)}"


def test_the_check_runs_as_the_manifest_and_the_image_say() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == image_check.UID
    security = container(deployment())["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and "--read-only" in image_check.K8S_SECURITY
    assert security["capabilities"]["drop"] == ["ALL"] and "ALL" in image_check.K8S_SECURITY
    assert security["allowPrivilegeEscalation"] is False and "no-new-privileges" in image_check.K8S_SECURITY
    assert [m["mountPath"] for m in container(deployment())["volumeMounts"]] == ["/tmp"]
    assert any(arg.startswith("/tmp:") for arg in image_check.K8S_SECURITY)
    assert [rest for kw, rest in final_stage() if kw == "USER"] == [f"{image_check.UID}:{image_check.UID}"]


def test_the_published_base_is_the_containerfiles_default() -> None:
    assert image_check.published_base() == f"docker.io/library/{build_args()['BASE_IMAGE']}"
