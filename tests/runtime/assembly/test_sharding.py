"""Sharding across devices (runtime.assembly.sharding): 4x1, 1x4 and 2x2 meshes of 4 fake CPU devices score as one
device does, for the embedded model and tiny random Llama/Qwen3; impossible layouts stop the start clearly."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from runtime.model import params
from runtime.model.config import load_config
from runtime.assembly.sharding import (MeshError, build_mesh_layout, check_batches, param_spec, parse_mesh,
                                       sharded_parts)
from tests.conftest import REPO
from tests.runtime.conftest import random_sequences, small_plan, tiny_checkpoint

MESHES = ("1x1", "4x1", "1x4", "2x2")  # "1x1": the unsharded single-device runtime, the reference
# Buckets divide by the data axis (4); prefix sharing on, so the context keys/values path runs sharded too;
# one completion bucket, so per-position log-probabilities (/v1/completions) run sharded too.
TINY_BUCKETS = dict(length_buckets=(64,), batch_buckets=(4,), context_buckets=(64,), suffix_batch_buckets=(4,),
                    suffix_length_buckets=(8,), completion_batch_buckets=(4,), max_labels=4, prefix_sharing=True,
                    dtype="float32")
# The embedded model compiles slowly on 2 cores: one (batch, length) bucket, no prefix sharing (the tiny
# models cover the context path, with KV heads replicated as the embedded model's would be).
EMBEDDED_BUCKETS = {**TINY_BUCKETS, "length_buckets": (32,), "batch_buckets": (8,), "prefix_sharing": False}
TINY_CASES = {
    # 8 query heads split 4 ways; 2 KV heads split on a model axis of 2 (2x2), replicated on 4 (1x4); biases.
    "llama": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    # q/k norms; 4 KV heads split 4 ways; head_dim 16 (not hidden / heads).
    "qwen3": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)),
    # experts split by their hidden units (32 over 4), the router replicated; Gemma 2-style parts are covered by
    # the same rules (post norms replicated; the per-layer window is scan data, not a parameter).
    "qwen3_moe": ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=4, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}
# A model axis reduces float32 partial sums in another order: the embedded model's 30 layers moved by up to 1.5e-5
# here (2.1e-5 measured with a 32-token bucket; its shapes with 2 layers run here now), the tiny models by 3.8e-6. A misplaced shard moves scores by >1e-2.
# The data axis alone (4x1) with the batch-invariant kernels (the CPU's default) gives one device's bits.
EMBEDDED_ATOL = 5e-5
TINY_ATOL = 1e-5


def requests(vocab: int, small: bool = False) -> list[tuple[list[list[int]], list[int]]]:
    rng = np.random.default_rng(7)
    query = rng.integers(0, vocab, 34).tolist()
    padded = (random_sequences(rng, 6, 1, 16, vocab), [0, 5, vocab - 1, 5])  # padded rows (and columns)
    if small:
        return [padded]
    return [padded, (random_sequences(rng, 11, 1, 16, vocab), [3, 1]),  # three device batches
            # a shared prefix: twelve items cost less after it (three batches of 4 x 32) than in full
            ([query + list(range(5 + i, 6 + i + i % 3)) for i in range(12)], [1, 2, 3])]


# XLA:CPU runs a device's collectives on its intra-op thread pool, sized by the host's cores but at least one thread
# per device (4 here). A 2x2 mesh's program holds independent collectives (an all-reduce over the model axis, an
# all-to-all over the data axis) that each device may take in another order: with every pool thread blocked at the
# rendezvous it took first, the others never start and XLA aborts after 40 s (seen in CI: four threads at four
# rendezvous of one run). NPROC sizes that pool (xla/pjrt/utils.cc DefaultThreadPoolSize): room for every device's
# collectives at once. Test-only: real accelerators run collectives on the device.
INTRA_OP_THREADS = "16"


def run_worker(spec: dict) -> tuple[dict, str]:
    """The worker's results and log."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "NPROC": INTRA_OP_THREADS}
    done = subprocess.run([sys.executable, "-m", "tests.runtime.assembly.sharding_worker", json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def sharded(embedded_shaped_dir, cache_dir, tmp_path_factory):
    """Scores of every job on every mesh, from one subprocess with 4 fake CPU devices. The meshes are compared with
    one device, so the embedded model's job runs its shapes (heads, widths, vocabulary) with 2 of its 30 layers
    (embedded_shaped_dir: the same sharding rules and programs, a fifteenth of the compute; 141 s -> see below)."""
    jobs = {"embedded": {"model_dir": str(embedded_shaped_dir), "settings": EMBEDDED_BUCKETS,
                         "requests": requests(49152, small=True)}}
    for name, (family, overrides) in TINY_CASES.items():
        model_dir = tmp_path_factory.mktemp(name)
        tiny_checkpoint(family, model_dir, **overrides)
        jobs[name] = {"model_dir": str(model_dir), "settings": TINY_BUCKETS, "requests": requests(128)}
    spec = {"cache_dir": str(cache_dir), "xla_dir": str(cache_dir / "xla-sharding"), "meshes": MESHES,
            "jobs": jobs}
    results, log = run_worker(spec)
    assert results["devices"] == ["cpu"] * 4
    return spec, results, log


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES[1:])
@pytest.mark.parametrize("job", ["embedded", *TINY_CASES])
def test_meshes_score_like_one_device(sharded, job, mesh):
    _, results, _ = sharded
    reference, ours = results["jobs"][job]["1x1"], results["jobs"][job][mesh]
    assert reference["layout"] is None, "1x1 must be the unsharded runtime"
    assert ours["layout"].startswith(f"mesh {mesh} (data x model) on 4 cpu devices")
    if mesh == "4x1":  # each device scores its rows with the single-device program: the same bits
        assert ours["layout"].endswith("each device scores its rows alone (batch-invariant)")
        for part in ("scores", "token_logprobs"):
            for expected, got in zip(reference[part], ours[part], strict=True):
                assert np.array_equal(np.array(got), np.array(expected)), part
    else:
        atol = EMBEDDED_ATOL if job == "embedded" else TINY_ATOL
        for expected, got in zip(reference["scores"], ours["scores"]):
            np.testing.assert_allclose(np.array(got), np.array(expected), atol=atol, rtol=0)
        # Per-position log-probabilities reach -22 (unlikely tokens): the same float32 noise, relative (1.05e-4 at
        # -13.5 measured on the embedded model, 4x1, with the default kernels).
        for expected, got in zip(reference["token_logprobs"], ours["token_logprobs"]):
            np.testing.assert_allclose(np.array(got), np.array(expected), atol=atol, rtol=2e-5)
    assert np.ptp(np.concatenate([np.ravel(s) for s in reference["scores"]])) > 1.0  # scores that could differ
    # Warm-up made every bucket of the sharded executables (compiled, from XLA's persistent cache, or, in a second
    # run, from the executable store); scoring compiled nothing.
    assert ours["compiles"] == ours["buckets"] == ours["stored"] + ours["cache_misses"] + ours["cache_hits"]
    assert ours["compiles_while_scoring"] == 0
    assert ours["ran"] == (["hidden", "label_logprobs", "token_logprobs"] if job == "embedded" else
                           ["hidden", "hidden_after_context", "label_logprobs", "prefill_context", "token_logprobs"])


@pytest.mark.slow
def test_packed_buckets_on_a_data_mesh_score_like_one_device(sharded, tmp_path_factory):
    """The accelerators' packed layout sharded 4x1 (row counts fitted to the data axis), in a worker of its own,
    against the tiny Qwen3's single-device (grid) scores."""
    spec, first, _ = sharded
    job = {**spec["jobs"]["qwen3"], "settings": {**TINY_BUCKETS, "bucket_layout": "packed"}}
    results, _ = run_worker({**spec, "xla_dir": str(tmp_path_factory.mktemp("xla-packed")), "meshes": ["4x1"],
                             "jobs": {"qwen3": job}})
    reference, ours = first["jobs"]["qwen3"]["1x1"], results["jobs"]["qwen3"]["4x1"]
    for expected, got in zip(reference["scores"], ours["scores"]):
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=TINY_ATOL, rtol=0)
    assert ours["compiles_while_scoring"] == 0
    assert ours["ran"] == ["hidden_packed", "hidden_packed_after_context", "label_logprobs", "prefill_context",
                           "token_logprobs"]


@pytest.mark.slow
def test_what_each_mesh_splits(sharded):
    _, results, log = sharded
    embedded, llama, qwen3 = (results["jobs"][name] for name in ("embedded", "llama", "qwen3"))
    # The embedded model's 9 query heads divide by neither 4 nor 2: attention replicated, with a log line.
    assert "attention replicated, KV heads replicated, MLP split, vocabulary split" in embedded["1x4"]["layout"]
    assert "9 query heads do not divide by 4 (a model axis of 3 or 9 would split them)" in log
    assert "over the model axis: attention replicated" in embedded["4x1"]["layout"]  # data parallel only
    assert embedded["4x1"]["param_specs"] == ["P()"]
    assert "attention split, KV heads replicated" in llama["1x4"]["layout"]  # 2 KV heads, 4 devices
    assert "attention split, KV heads split, MLP split, vocabulary split" in llama["2x2"]["layout"]
    assert "attention split, KV heads split, MLP split, vocabulary split" in qwen3["1x4"]["layout"]
    assert "P(None, None, 'model')" in qwen3["1x4"]["param_specs"]


@pytest.mark.slow
def test_second_start_loads_sharded_executables_without_tracing(sharded):
    """A second process loads the stored executables of a mesh, and those of the unsharded runtime onto its one
    device (not onto all four: JAX's default for a deserialized executable)."""
    spec, first, _ = sharded
    again = {**spec, "meshes": ["1x1", "2x2"], "jobs": {"qwen3": spec["jobs"]["qwen3"]}}
    results, _ = run_worker(again)
    for mesh in ("1x1", "2x2"):
        second = results["jobs"]["qwen3"][mesh]
        # All from the executable store (those the first run loaded from the persistent cache too): nothing compiled
        assert second["stored"] == second["buckets"], mesh
        assert second["cache_misses"] == 0
        assert second["compiles_while_scoring"] == 0
        for expected, got in zip(first["jobs"]["qwen3"][mesh]["scores"], second["scores"], strict=True):
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


# ---- start-up errors and layout rules (no devices needed) ------------------------------------------------


@pytest.fixture(scope="module")
def smollm(embedded_dir):
    return load_config(embedded_dir)  # 9 heads, 3 KV heads, MLP 1536, vocabulary 49152


def test_parse_mesh():
    assert parse_mesh("", 4) == (4, 1)
    assert parse_mesh(" 2X2 ", 4) == (2, 2)
    assert parse_mesh("1x2", 4) == (1, 2)  # fewer devices than the host has: allowed, logged
    with pytest.raises(MeshError, match="needs 8 devices, this host has 4"):
        parse_mesh("2x4", 4)
    for bad in ("4", "0x4", "2x", "axb"):
        with pytest.raises(MeshError, match="not DATAxMODEL"):
            parse_mesh(bad, 4)


def test_one_device_is_not_sharded(smollm):
    assert build_mesh_layout("", smollm, small_plan(batches=(1, 8)), devices=["device"]) is None
    assert build_mesh_layout("1x1", smollm, small_plan(batches=(1, 8)), devices=["d0", "d1"]) is None


def _declared(*cfgs) -> dict[str, params.ParamInfo]:
    """The parameters any of these configs declares (runtime.model.params), by name."""
    return {name: info for cfg in cfgs for name, info in params.declare(cfg).items()}


def test_parameter_specs(smollm, caplog):
    with caplog.at_level(logging.WARNING, "scorefn.runtime"):
        parts = sharded_parts(smollm, 4)
    assert parts == {"attention": False, "kv": False, "mlp": True, "vocab": True}
    assert "9 query heads do not divide by 4" in caplog.text
    declared = _declared(smollm)  # rebound below: `spec` reads the current one
    spec = lambda name, parts, one_layer=False: param_spec(declared.get(name), parts, one_layer)
    assert spec("layers.wq", parts) == spec("layers.wk", parts) == spec("layers.wo", parts) == P()
    assert spec("layers.w_up", parts) == P(None, None, "model")
    assert spec("layers.w_down", parts) == P(None, "model", None)
    assert spec("layers.w_down", parts, one_layer=True) == P("model", None)  # an unrolled model's layer: no layer axis
    assert spec("layers.wq", parts, one_layer=True) == P()
    assert spec("embed", parts) == P("model", None)

    gqa = dataclasses.replace(smollm, num_heads=8, num_kv_heads=2)
    # every kind of parameter: biases, q/k and output norms, experts, a classification head
    declared = _declared(dataclasses.replace(gqa, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm="head",
                                             post_norms=True),
                         dataclasses.replace(gqa, num_experts=4, moe_intermediate_size=32, experts_per_token=2),
                         dataclasses.replace(gqa, task="sequence_classification", num_labels=2))
    parts = sharded_parts(gqa, 4)  # query heads split, the 2 KV heads replicated
    assert spec("layers.wq", parts) == P(None, None, "model")
    assert spec("layers.bq", parts) == P(None, "model")
    assert spec("layers.wk", parts) == spec("layers.bv", parts) == P()
    assert spec("layers.wk", sharded_parts(gqa, 2)) == P(None, None, "model")
    assert spec("layers.experts_up", parts) == P(None, None, None, "model")
    assert spec("layers.experts_down", parts) == P(None, None, "model", None)
    for always_replicated in ("layers.attn_norm", "layers.k_norm", "layers.bo", "layers.b_down", "final_norm",
                              "score_head", "inv_freq", "layers.attn_post_norm", "layers.mlp_post_norm",
                              "layers.router", "local_inv_freq", "something_new"):
        assert spec(always_replicated, sharded_parts(gqa, 2)) == P()
    assert {"layers.k_norm", "layers.bo", "layers.router", "score_head"} <= declared.keys()


def test_a_model_axis_that_splits_nothing_is_a_start_up_error(smollm):
    odd = dataclasses.replace(smollm, intermediate_size=1534, vocab_size=49153)
    with pytest.raises(MeshError, match=r"model axis of 4 devices splits nothing of this model: its 9 attention "
                                        r"heads, 1534 MLP hidden units and 49153-token vocabulary are not "
                                        r"multiples of 4; .* \(SCOREFN_MESH=8x1\)"):
        build_mesh_layout("2x4", odd, small_plan(batches=(2, 8)), devices=list(range(8)))


def test_batch_buckets_not_divisible_by_the_data_axis_are_a_start_up_error(smollm):
    plan = small_plan(batches=(1, 2, 8), prefix_sharing=True, suffix_batches=(6, 12), completion_batches=(1, 4))
    with pytest.raises(MeshError) as caught:
        build_mesh_layout("", smollm, plan, devices=list(range(4)))
    message = str(caught.value)
    assert "SCOREFN_MESH empty: all local devices on the data axis" in message
    assert ("SCOREFN_BATCH_BUCKETS has 1, 2; SCOREFN_SUFFIX_BATCH_BUCKETS has 6; "
            "SCOREFN_COMPLETION_BATCH_BUCKETS has 1") in message
    assert "Use multiples of 4 (e.g. 4,8,16,32)" in message
    with pytest.raises(MeshError, match=r"SCOREFN_BATCH_BUCKETS has 1\. Use multiples of 2"):
        build_mesh_layout("2x2", smollm, small_plan(batches=(1, 2, 8), prefix_sharing=True, suffix_batches=(4,),
                                                    completion_batches=(2,)),
                          devices=list(range(4)))


@pytest.mark.slow
def test_engine_start_fails_clearly_on_a_mesh_larger_than_the_host(cache_dir, tmp_path):
    import jax

    from runtime.engine import Engine
    from runtime.settings import load_settings

    too_many = f"{jax.local_device_count() + 1}x1"
    engine = Engine(load_settings(cache_dir=str(cache_dir), compile_cache_dir=str(tmp_path), mesh=too_many))
    with pytest.raises(MeshError, match=f"SCOREFN_MESH={too_many} needs"):
        engine.start()
    assert engine.scorer is None and not engine.ready


def test_the_tpu_overlay_mesh_and_buckets_fit_the_embedded_model(smollm):
    """infra/k8s/overlays/tpu runs the embedded model on a 2x2 slice (4 chips) with its SCOREFN_* env."""
    import yaml

    from runtime.assembly.compose import bucket_plan
    from runtime.assembly.platform import resolve
    from runtime.settings import load_settings

    deployment = yaml.safe_load((REPO / "infra/k8s/overlays/tpu/deployment-tpu.yaml").read_text())
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    settings = load_settings(environ=env)
    data, model = parse_mesh(settings.mesh, 4)
    assert (data, model) == (4, 1)
    plan = bucket_plan(settings, resolve(settings, backend="tpu", data=data))
    check_batches(plan, data, settings.mesh)  # every batch, suffix and completion batch bucket divides
    assert not any(sharded_parts(smollm, model, data).values())  # data parallel: a whole model per chip
