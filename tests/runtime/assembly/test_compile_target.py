"""`scorefn compile --target`: targets as data; a compile from config.json alone fills the executable store that a
start with the weights loads without compiling; a start that finds another set, or an executable that does not
load, says why in one log line and compiles instead."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from runtime.engine import Engine
from runtime.assembly.targets import TargetError, parse_target
from runtime.settings import load_settings
from runtime.tools.compile import compile_target
from tests.conftest import top_level_imports

pytestmark = pytest.mark.slow
# Three executables of the embedded model: one full bucket, its label head, one completion bucket.
BUCKETS = dict(dtype="float32", length_buckets=(16,), batch_buckets=(2,), prefix_sharing=False,
               completion_batch_buckets=(1,), max_labels=4, batch_wait_ms=0.0)


@pytest.mark.parametrize("name,backend,count,kind", [
    ("l4", "gpu", 1, "NVIDIA L4"), ("h100:4", "gpu", 4, "NVIDIA H100 80GB HBM3"),
    ("tpu-v5e:2x2", "tpu", 4, "TPU v5 lite"), ("tpu-v6e", "tpu", 1, "TPU v6 lite"), ("cpu", "cpu", 1, "cpu"),
    ("a100", "gpu", 1, "NVIDIA A100-SXM4-80GB")])
def test_targets_name_their_devices(name, backend, count, kind):
    target = parse_target(name)
    assert (target.backend, target.device_count, target.chip.device_kind) == (backend, count, kind)
    if backend != "cpu":
        assert target.chip.memory_bytes and target.chip.peak_bf16_flops and target.chip.memory_bandwidth


def test_the_fingerprint_reads_the_programs_sources_not_admissions():
    """Scheduling and admission (which never build a JAX program) can change without invalidating stored
    executables; everything that does build one is in the fingerprint's source digest."""
    from pathlib import Path

    from runtime.assembly import store

    runtime = Path(store.__file__).parent.parent
    read = {p.relative_to(runtime).as_posix() for p in store.source_files()}
    assert {"model/transformer.py", "model/attention.py", "shapes/packed.py", "shapes/programs.py", "shapes/grid.py",
            "assembly/executables.py", "assembly/compose.py"} <= read
    for path in sorted([runtime / "engine.py", *runtime.glob("requests/*.py"), *runtime.glob("assembly/*.py")]):
        if path.relative_to(runtime).as_posix() in read:
            continue
        assert not _builds_programs(path), f"{path.name} builds programs: fingerprint it"


def _builds_programs(path) -> bool:
    """Whether a module can build a JAX program: it imports Flax or a JAX submodule, or uses JAX for more than
    fetching arrays (the scorer's jax.device_get)."""
    import ast

    tree = ast.parse(path.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    if top_level_imports(path) & {"flax"} or any(name.startswith("jax") and name != "jax" for name in imported):
        return True
    return any(isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax"
               and node.attr not in {"device_get", "block_until_ready", "Array"} for node in ast.walk(tree))


@pytest.mark.parametrize("name", ["v100", "tpu-v5e:4", "h100:2x2", "l4:0"])
def test_unknown_targets_and_counts_are_refused(name):
    with pytest.raises(TargetError):
        parse_target(name)


def test_the_gpu_target_config_describes_the_device():
    text = parse_target("l4").gpu_target_config()
    assert 'device_description_str: "NVIDIA L4"' in text and "core_count: 58" in text
    assert "cuda_compute_capability { major: 8 minor: 9 }" in text


@pytest.fixture
def config_only(embedded_dir, tmp_path):
    """The served model's config.json alone, as a deploy without mounted weights has it at build time."""
    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(embedded_dir / "config.json", directory / "config.json")
    return directory / "config.json"


def settings_for(model, xla_dir, cache_dir, **overrides):
    return load_settings(environ={}, model=str(model), cache_dir=str(cache_dir), compile_cache_dir=str(xla_dir),
                         **{**BUCKETS, **overrides})


def start(settings) -> Engine:
    engine = Engine(settings)
    engine.start()
    engine.stop(1)
    return engine


def test_a_config_only_compile_is_loaded_by_a_start_with_the_weights(config_only, embedded_dir, tmp_path, cache_dir):
    xla = tmp_path / "xla"
    report = compile_target("cpu", settings_for(config_only, xla, cache_dir),
                            json_out=str(tmp_path / "compile.json"))
    assert report["count"] == len(report["executables"]) > 0 and not report["too_large"]
    assert all(row["serialized_bytes"] > 0 and row["attention"] == "xla" for row in report["executables"])
    assert json.loads((tmp_path / "compile.json").read_text())["fingerprint"] == report["fingerprint"]
    engine = start(settings_for(embedded_dir, xla, cache_dir))
    assert engine.scorer.exe.fingerprint == report["fingerprint"]
    assert engine.timings["stored"] == engine.timings["buckets"] == report["count"]  # nothing traced or compiled
    assert engine.timings["cache_misses"] == 0


def test_a_start_that_finds_another_set_says_what_differs_and_compiles(config_only, embedded_dir, tmp_path, cache_dir,
                                                                        caplog):
    xla = tmp_path / "xla"
    compile_target("cpu", settings_for(config_only, xla, cache_dir))
    with caplog.at_level(logging.INFO, logger="scorefn.runtime"):  # bfloat16, layers still scanned (compiles fast)
        engine = start(settings_for(embedded_dir, xla, cache_dir, dtype="bfloat16", layer_loop="scan"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executable store")]
    assert len(lines) == 1 and "differs in model" in lines[0] and "compiling every bucket" in lines[0], lines
    assert engine.timings["stored"] == 0 and engine.timings["buckets"] > 0


def test_an_executable_that_does_not_load_is_compiled_instead(config_only, embedded_dir, tmp_path, cache_dir, caplog):
    xla = tmp_path / "xla"
    report = compile_target("cpu", settings_for(config_only, xla, cache_dir))
    for stored in sorted((xla / "executables" / report["fingerprint"]).glob("*.jaxexe")):
        stored.write_bytes(b"not an executable")  # as one from another build or device would fail
    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        engine = start(settings_for(embedded_dir, xla, cache_dir))
    lines = [r.getMessage() for r in caplog.records if "did not load" in r.getMessage()]
    assert len(lines) == 1 and "compiling" in lines[0], lines
    assert engine.timings["stored"] == 0 and engine.scorer.exe.compiles == engine.timings["buckets"]
