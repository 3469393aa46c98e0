"""Deviceless ahead-of-time compilation: every entry point compiles for an H100 (bfloat16, cuDNN attention in every
layer body) and a TPU v5e on this CPU host, serializes into the executable store, and under the fingerprint a start
with the weights on the same target computes; sharded cuDNN programs (an H100 x4 mesh) serialize too. Gemma 2
(soft-capped attention: XLA on the GPU) and Qwen3-MoE (top-k routing in every layer) compile for both targets.

The accelerator plugins live in their own venv (.venv-aot, `make setup-aot`, the `aot` extra): installed beside the
test tools they print CUDA/TPU start-up errors into every JAX process. So one worker process there
(tests/aot/aot_worker.py) compiles every case, on a tiny 3-layer config, and these tests read its report.
Whether these executables load on the real devices cannot be shown here (runtime.assembly.executables falls back
to compiling when one does not).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from runtime.assembly.platform import ACCELERATOR_STREAM_CHUNK
from runtime.assembly.store import compile_env
from tests.conftest import CACHE_DIR, REPO

AOT_PYTHON = Path(os.environ.get("SCOREFN_AOT_PYTHON", REPO / ".venv-aot" / "bin" / "python"))
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
LAYERS = TINY["num_hidden_layers"]
# Two length buckets (one above the packed row width of 32: a wide row too), one context, few labels.
BUCKETS = {"length_buckets": [32, 64], "context_buckets": [32], "max_labels": 4}
# And a context bucket that holds a prompt the prefix cache keeps (256 tokens or more): its programs too.
PROMPT_CACHE_BUCKETS = {**BUCKETS, "length_buckets": [32, 64, 256], "context_buckets": [32, 256]}
# What the other families compile: the packed layer bodies (in full, after a context) and every position's top-k.
FAMILY_METHODS = {"prefill_context", "hidden_packed", "hidden_packed_after_context", "token_logprobs"}
# The prefix cache's programs: a prompt read at every position kept whole, the rest of one after it; a cached context
# extended by the tokens after it.
PROMPT_CACHE = {"token_logprobs_context", "token_logprobs_after_context", "extend_context"}
PACKED = {"prefill_context", "hidden_packed", "hidden_packed_after_context", "label_logprobs", "token_logprobs",
          *PROMPT_CACHE}
GRID = {"hidden", "hidden_after_context"}
INVARIANT_BODIES = {"prefill_context", *GRID}
BODIES = {"prefill_context", "hidden_packed", "hidden_packed_after_context", "token_logprobs", *PROMPT_CACHE, *GRID}


@pytest.fixture(scope="session")
def deviceless(tmp_path_factory) -> dict:
    if not AOT_PYTHON.is_file():
        pytest.fail(f"{AOT_PYTHON} is missing: `make setup-aot` installs the accelerator plugins (the aot extra)")
    tmp = tmp_path_factory.mktemp("aot")
    for name, overrides in (("causal", {}), ("classify", {"architectures": ["LlamaForSequenceClassification"],
                                                         "num_labels": 3})):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({**TINY, **overrides}))
    causal, classify = str(tmp / "causal"), str(tmp / "classify")
    families = {case: str(family_config(case, tmp / case)) for case in ("gemma2", "qwen3_moe_linear_rope")}
    grid = {**BUCKETS, "bucket_layout": "grid", "batch_buckets": [1], "suffix_length_buckets": [8],
            "suffix_batch_buckets": [4]}
    cases = [case for name, target in (("h100", "h100"), ("tpu", "tpu-v5e")) for case in (
        {"name": name, "target": target, "config_dir": causal, "settings": PROMPT_CACHE_BUCKETS, "start_side": True},
        {"name": f"{name}_grid", "target": target, "config_dir": causal, "methods": sorted(GRID), "settings": grid},
        {"name": f"{name}_classify", "target": target, "config_dir": classify, "methods": ["class_logits"],
         "settings": BUCKETS})]
    # The batch-invariant kernels (SCOREFN_BATCH_INVARIANT=true): every bucket of the layer bodies, for the check
    # that one set of attention tile shapes serves them all.
    invariant = {**grid, "batch_invariant": "true", "batch_buckets": [1, 2], "suffix_length_buckets": [8, 16]}
    cases += [{"name": f"{name}_invariant", "target": target, "config_dir": causal, "settings": invariant,
               "methods": sorted(INVARIANT_BODIES), "every_bucket": True}
              for name, target in (("h100", "h100"), ("tpu", "tpu-v5e"))]
    # LoRA adapter slots (SCOREFN_MAX_LORAS): the stacked updates are parameters, the adapters' weights never needed.
    cases += [{"name": f"{name}_lora", "target": target, "config_dir": causal, "start_side": True,
               "settings": {**PROMPT_CACHE_BUCKETS, "max_loras": 4, "max_lora_rank": 8}, "methods": sorted(PACKED)}
              for name, target in (("h100", "h100"), ("tpu", "tpu-v5e"))]
    cases += [
        {"name": "l4_small", "target": "l4", "config_dir": causal, "methods": ["hidden_packed"], "settings": BUCKETS,
         "memory_fraction": 1e-6},  # 24 kB usable: the bucket does not fit
        {"name": "h100x4", "target": "h100:4", "config_dir": causal, "settings": {**BUCKETS, "mesh": "4x1"},
         "methods": ["prefill_context", "hidden_packed", "hidden_packed_after_context"]},
        # Soft-capped attention and per-layer windows (XLA on the GPU too); routed experts (top-k in every layer).
        *({"name": f"{target}_{case}", "target": target, "config_dir": config_dir, "settings": BUCKETS,
           "methods": sorted(FAMILY_METHODS), "start_side": True}
          for target in ("h100", "tpu-v5e") for case, config_dir in families.items()),
    ]
    spec = {"xla_dir": str(tmp / "xla"), "cases": cases}
    kept = KEPT_REPORTS / f"{report_key(spec)}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    done = subprocess.run([str(AOT_PYTHON), "-m", "tests.aot.aot_worker", json.dumps(spec)], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    report = done.stdout.splitlines()[-1]
    shutil.rmtree(KEPT_REPORTS, ignore_errors=True)  # one report kept: an older source's is never read again
    KEPT_REPORTS.mkdir(parents=True)
    kept.with_suffix(".tmp").write_text(report)
    kept.with_suffix(".tmp").rename(kept)
    return json.loads(report)


# The worker's report, kept (user-level, as the compile caches) under a digest of everything that shapes it: a second
# run, or a second clone of the same source, reads the deviceless compiles' outcome instead of compiling ~40 programs
# again (85 s on 2 cores; the deviceless compiles do not come back from XLA's persistent cache). Every assertion below
# still runs on it. A changed runtime source, worker, case, JAX/XLA variable or accelerator lock (jaxlib and the
# plugins' versions) compiles again.
KEPT_REPORTS = CACHE_DIR / "test-deviceless"


def report_key(spec: dict, repo: Path = REPO, environ: Mapping[str, str] = os.environ) -> str:
    digest = hashlib.sha256()
    for path in [*sorted((repo / "runtime").rglob("*.py")), repo / "tests" / "aot" / "aot_worker.py",
                 repo / "lock" / "aot.txt"]:
        digest.update(f"{path.relative_to(repo)}".encode() + b"\0" + path.read_bytes() + b"\0")
    cases = [{**case, "config_dir": (Path(case["config_dir"]) / "config.json").read_text()} for case in spec["cases"]]
    digest.update(json.dumps([cases, compile_env(environ)]).encode())
    return digest.hexdigest()[:24]


def test_a_changed_source_case_flag_or_accelerator_lock_misses_the_kept_report(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "runtime", repo / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "tests" / "aot").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "aot" / "aot_worker.py", repo / "tests" / "aot")
    (repo / "lock").mkdir()
    lock = (REPO / "lock" / "aot.txt").read_text()
    (repo / "lock" / "aot.txt").write_text(lock)
    (tmp_path / "causal").mkdir()
    (tmp_path / "causal" / "config.json").write_text(json.dumps(TINY))
    spec = {"xla_dir": str(tmp_path / "xla"), "cases": [{"name": "h100", "target": "h100",
                                                         "config_dir": str(tmp_path / "causal"), "settings": BUCKETS}]}
    key = report_key(spec, repo, {})
    assert report_key({**spec, "xla_dir": "elsewhere"}, repo, {"JAX_COMPILATION_CACHE_DIR": "/x"}) == key
    assert report_key(spec, repo, {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}) != key
    assert report_key({**spec, "cases": [{**spec["cases"][0], "target": "tpu-v5e"}]}, repo, {}) != key
    layers = repo / "runtime" / "model" / "layers.py"
    layers.write_text(layers.read_text() + "\n")
    assert report_key(spec, repo, {}) != key
    layers.write_text((REPO / "runtime" / "model" / "layers.py").read_text())
    assert report_key(spec, repo, {}) == key
    assert "\njaxlib==" in lock
    (repo / "lock" / "aot.txt").write_text(lock.replace("\njaxlib==", "\njaxlib==9"))
    assert report_key(spec, repo, {}) != key


def family_config(case: str, directory: Path) -> Path:
    """config.json of a tiny case of tests/runtime (tests.runtime.conftest.CASES) as transformers writes it."""
    import transformers

    from tests.runtime.conftest import CASES, FAMILIES, TINY

    family, overrides = CASES[case]
    config_class, model_class = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    config.architectures = [model_class]
    config.save_pretrained(directory)
    return directory


def by_method(case: dict) -> dict[str, dict]:
    return {row["method"]: row for row in case["executables"]}


def test_every_entry_point_compiles_for_an_h100_with_cudnn_in_every_layer_body(deviceless):
    rows = {**by_method(deviceless["h100"]), **by_method(deviceless["h100_grid"]),
            **by_method(deviceless["h100_classify"])}
    assert set(rows) == PACKED | GRID | {"class_logits"}
    assert "attention cudnn in bfloat16" in deviceless["h100"]["platform"]
    for method, row in rows.items():
        assert row["serialized_bytes"] > 0, method
        if method in BODIES:  # the scanned layer loop's body holds the fused-attention custom call
            assert (row["attention"], row["cudnn_layer_loops"], row["layer_loops"]) == ("cudnn", 1, 1), method
        else:  # heads: no attention
            assert row["attention"] == "xla", method


def test_every_entry_point_compiles_for_a_tpu_v5e(deviceless):
    rows = {**by_method(deviceless["tpu"]), **by_method(deviceless["tpu_grid"]),
            **by_method(deviceless["tpu_classify"])}
    assert set(rows) == PACKED | GRID | {"class_logits"}
    assert "tpu: bfloat16" in deviceless["tpu"]["platform"]
    for method, row in rows.items():
        assert row["serialized_bytes"] > 0 and row["attention"] == "xla", method
        assert row["flops"] > 0 and row["temp_bytes"] is not None, method  # TPU cost and memory analysis


def test_a_compile_and_a_start_on_the_same_target_compute_the_same_fingerprint(deviceless):
    for name, kind in (("h100", "NVIDIA H100 80GB HBM3"), ("tpu", "TPU v5 lite")):
        case = deviceless[name]
        assert case["fingerprint"] == case["start_fingerprint"], name  # config.json alone vs the weights
        assert case["devices"][:3] == [case["devices"][0], kind, 1]
    assert deviceless["h100"]["fingerprint"] != deviceless["tpu"]["fingerprint"]


def test_lora_slots_compile_deviceless_under_the_fingerprint_a_start_computes(deviceless):
    """`scorefn compile --target` with SCOREFN_MAX_LORAS covers the adapters: every program compiles with the slots,
    and a start with the weights (whatever adapters fill the slots) finds them under the same fingerprint."""
    for name in ("h100", "tpu"):
        case = deviceless[f"{name}_lora"]
        assert set(by_method(case)) == PACKED and all(r["serialized_bytes"] > 0 for r in case["executables"])
        assert case["fingerprint"] == case["start_fingerprint"] != deviceless[name]["fingerprint"], name


def test_sharded_cudnn_programs_serialize(deviceless):
    """jax 0.10.2 keeps custom-partitioning callbacks (a local function pickle refuses) on sharded cuDNN programs;
    the store serializes them without (runtime.assembly.executables._without_partitioning_callbacks)."""
    case = deviceless["h100x4"]
    assert case["devices"][2:] == [4, [4, 1]]
    for method, row in by_method(case).items():
        assert row["attention"] == "cudnn" and row["serialized_bytes"] > 0, method


def test_a_bucket_larger_than_the_device_fails_the_build_naming_bucket_and_bytes(deviceless):
    [problem] = deviceless["l4_small"]["memory_problems"]
    assert problem.startswith("bucket hidden_packed(1, 16, 4) needs ") and "on one NVIDIA L4" in problem
    assert "temporaries" in problem and "GB usable" in problem


@pytest.mark.parametrize("case", ["gemma2", "qwen3_moe_linear_rope"])
def test_gemma2_and_qwen3_moe_compile_for_an_h100_and_a_tpu_v5e(deviceless, case):
    """Gemma 2 soft-caps its attention scores, which cuDNN cannot: XLA attention on the H100 (its soft-capped path on
    every layer body, the cascade's and packed rows' included); Qwen3-MoE routes with top-k in every layer body and
    keeps cuDNN."""
    h100, tpu = deviceless[f"h100_{case}"], deviceless[f"tpu-v5e_{case}"]
    gemma = case == "gemma2"
    # XLA attention on a GPU runs in float32 (runtime.assembly.platform.attention_dtype), cuDNN in bfloat16.
    assert ("attention xla in float32" if gemma else "attention cudnn in bfloat16") in h100["platform"]
    for method, row in by_method(h100).items():
        assert row["serialized_bytes"] > 0 and row["layer_loops"] == 1, method
        assert row["cudnn_layer_loops"] == (0 if gemma else 1), method
    for method, row in by_method(tpu).items():
        assert row["serialized_bytes"] > 0 and row["flops"] > 0 and row["attention"] == "xla", method
    assert set(by_method(h100)) == set(by_method(tpu)) == FAMILY_METHODS
    for side in (h100, tpu):  # config.json alone (fused parts, stacked experts) and the weights: one fingerprint
        assert side["fingerprint"] == side["start_fingerprint"]


def test_the_batch_invariant_gpu_programs_pass_every_row_through_one_set_of_gemms_and_one_attention_kernel(deviceless):
    """What can be shown without the device, from the optimized HLO of every bucket of every layer body (whole rows of
    32 and 64 tokens, 1 or 2 rows, items of 8 or 16 after a prefix, the prefix itself): every matmul a row passes
    through in a layer has one shape whatever the bucket (the token stream in chunks of ACCELERATOR_STREAM_CHUNK),
    the attention is Pallas kernels in every layer body (not per-tile XLA dots), no cuDNN; XLA's deterministic
    mode and no autotuning. Whether the bits then hold on the device: tests/gpu/test_invariance_on_gpu.py."""
    case = deviceless["h100_invariant"]
    assert "batch-invariant on" in case["platform"] and "attention pallas in bfloat16" in case["platform"]
    rows = case["executables"]
    assert {row["method"] for row in rows} == INVARIANT_BODIES and len(rows) >= 7, [row["bucket"] for row in rows]
    gemms = {tuple(row["layer_gemms"]) for row in rows}
    assert len(gemms) == 1 and gemms != {()}, gemms
    assert all(shape.split("[")[1].startswith(f"{ACCELERATOR_STREAM_CHUNK},") for shape in next(iter(gemms))), gemms
    for row in rows:
        assert (row["pallas_layer_loops"], row["cudnn_layer_loops"], row["layer_loops"]) == (1, 0, 1), row["bucket"]
        assert row["attention_dots"] == [] and row["serialized_bytes"] > 0 and row["attention"] == "pallas", \
            row["bucket"]
    assert case["compiler_options"] == {"xla_gpu_exclude_nondeterministic_ops": True, "xla_gpu_autotune_level": 0}


def test_the_batch_invariant_tpu_programs_pass_every_row_through_one_set_of_gemms_and_one_attention_kernel(
        deviceless):
    """The same design for a TPU v5e, compiled deviceless: the token stream in fixed chunks (one set of matmul shapes
    in every bucket's layer body) and attention as a Mosaic kernel in the layer loop (runtime.model.
    pallas_tpu_attention), no per-tile XLA dots; the default programs hold no kernel there. Not run on a TPU (none is
    lent): whether its bits hold there is unshown."""
    case = deviceless["tpu_invariant"]
    assert "batch-invariant on" in case["platform"] and "attention pallas_tpu in bfloat16" in case["platform"]
    rows = case["executables"]
    assert {row["method"] for row in rows} == INVARIANT_BODIES and len(rows) >= 7
    stream = {tuple(s for s in row["loop_gemms"] if s.split("[")[1].startswith(f"{ACCELERATOR_STREAM_CHUNK},"))
              for row in rows}
    assert len(stream) == 1 and stream != {()}, stream
    for row in rows:
        assert row["loop_kernels"] == ["tpu_custom_call"] and row["attention_dots"] == [], row["bucket"]
        assert row["attention"] == "pallas", row["bucket"]  # what `scorefn compile --json-out` says
        assert row["serialized_bytes"] > 0 and row["cudnn_layer_loops"] == 0, row["bucket"]
    assert all(row["loop_kernels"] == [] for row in deviceless["tpu_grid"]["executables"])
    assert case["compiler_options"] == {}
