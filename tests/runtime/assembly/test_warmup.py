"""Every bucket is compiled at warm-up, through the persistent cache; requests never compile."""

from __future__ import annotations

import math
import shutil
import threading

import numpy as np
import pytest

from runtime.assembly import platform as platforms
from runtime.assembly import store as executables
from runtime.engine import Engine
from runtime.interface import Sampling
from runtime.settings import load_settings
from tests.runtime.conftest import EPYC, SAPPHIRE_RAPIDS, random_sequences

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    """What these tests count (compiles, stored and loaded executables) does not depend on the model's size; the
    programs of two layers compile in a fraction of 30 layers' time."""
    return tiny_llama_dir


def small_settings(model_dir, cache_dir, xla_dir, **overrides):
    """As few buckets as a start has (one of each program): what these tests count is per bucket, whatever their
    number; the first test splits requests over a richer set."""
    values = dict(model=str(model_dir), cache_dir=str(cache_dir), compile_cache_dir=str(xla_dir), dtype="float32",
                  length_buckets=(32,), batch_buckets=(2,), suffix_length_buckets=(8,), suffix_batch_buckets=(4,),
                  completion_batch_buckets=(2,), max_labels=4, batch_wait_ms=0.0)
    return load_settings(**{**values, **overrides})


# The buckets of one cold start that the tests below copy where they do not assert a cold compile themselves: its
# store holds every bucket of every plan of these tests but the first test's and those with adapters.
STORED = dict(length_buckets=(16, 32), batch_buckets=(2,))


@pytest.fixture(scope="module")
def stored(model_dir, cache_dir, tmp_path_factory):
    """(the compile cache directory of one cold start with STORED, its scores of REQUEST): copy it (`copy_of`)."""
    xla_dir = tmp_path_factory.mktemp("stored") / "xla"
    engine = Engine(small_settings(model_dir, cache_dir, xla_dir, **STORED))
    engine.start()
    try:
        assert engine.timings["stored"] == 0 and engine.timings["cache_misses"] == engine.plan.count()
        return xla_dir, engine.score(REQUEST, [1, 2])
    finally:
        engine.stop(5)


REQUEST = [[5, 6, 7], [8, 9]]


def copy_of(stored, tmp_path):
    """A test's own copy of the stored start's compile cache and executable store."""
    shutil.copytree(stored[0], tmp_path / "xla")
    return tmp_path / "xla"


def test_warmup_compiles_each_bucket_once_and_requests_compile_nothing(model_dir, cache_dir, tmp_path):
    engine = Engine(small_settings(model_dir, cache_dir, tmp_path / "xla", length_buckets=(16, 32),
                                   batch_buckets=(1, 4), completion_batch_buckets=(1, 8), max_labels=8))
    engine.start()
    try:
        plan = engine.plan
        assert engine.stats()["compiles"] == plan.count() == engine.timings["buckets"]
        assert engine.timings["cache_misses"] == plan.count()
        before = engine.stats()
        rng = np.random.default_rng(0)
        for n_items, n_labels in [(1, 1), (3, 5), (9, 8), (2, 2)]:  # full and shared-prefix paths, splits
            sequences = random_sequences(rng, n_items, 1, 32, 49152)
            assert engine.score(sequences, list(range(n_labels))).shape == (n_items, n_labels)
        query = random_sequences(rng, 1, 20, 20, 49152)[0]
        engine.score([query + [5, 6], query + [7], query + [8, 9, 10]], [1, 2])  # shares a 20-token prefix
        # Per-position log-probabilities, alongside scoring in the same round.
        scored = engine.submit(random_sequences(rng, 3, 1, 32, 49152), [4])
        tokens = engine.submit_logprobs(random_sequences(rng, 9, 2, 32, 49152), [Sampling()] * 9)
        assert scored.result().logprobs.shape == (3, 1) and len(tokens.result().sequences) == 9
        after = engine.stats()
        assert after["compiles"] == before["compiles"]
        assert after["backend_compiles"] == before["backend_compiles"]  # not one XLA compilation in the process
    finally:
        engine.stop(5)


def test_second_warmup_loads_every_bucket_without_tracing(model_dir, cache_dir, tmp_path, stored):
    xla_dir = tmp_path / "xla"
    first = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,)))
    first.start()
    first.stop(5)
    assert first.timings["stored"] == 0 and first.timings["cache_misses"] == first.plan.count()
    files = list((xla_dir / "executables").glob("*/*.jaxexe"))
    assert len(files) == first.plan.count(), "the executable store wrote no files"
    second = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,)))
    compiled_before = executables.cache_events()["backend_compiles"]
    second.start()
    try:
        assert second.timings["stored"] == second.plan.count()  # loaded from the store: nothing traced
        assert second.timings["cache_misses"] == 0 and second.timings["cache_hits"] == 0
        scores = second.score(REQUEST, [1, 2])
        assert all(second.scorer.exe.ensure(*key) for key in second.scorer.exe.deferred_keys())  # beside the start's
        assert second.scorer.exe.loaded == second.plan.count()
        assert executables.cache_events()["backend_compiles"] == compiled_before  # and nothing compiled
        np.testing.assert_allclose(scores, stored[1], atol=1e-6, rtol=0)  # a freshly compiled start's
    finally:
        second.stop(5)


def test_stored_buckets_load_when_first_run_or_after_ready(model_dir, cache_dir, tmp_path, stored):
    """A start loads one stored executable (a store that does not load is then compiled instead, before ready) and
    defers the others: a round loads what it runs, never compiling, and the engine loads the rest after ready, on
    one thread that stop() ends."""
    from runtime.assembly import startup
    from runtime.requests.jobs import Job

    settings = small_settings(model_dir, cache_dir, copy_of(stored, tmp_path), **STORED)
    built, _ = startup.serving_scorer(settings, startup.load(settings))
    compiled_before = executables.cache_events()["backend_compiles"]
    warmed = startup.warm_up(built)
    exe, count = built.exe, built.plan.count()
    assert warmed["stored"] == count and exe.loaded == 1 and exe.deferred == count - 1
    scores = built.score_jobs([Job(REQUEST, [1, 2])])[0]
    assert 1 < exe.loaded < count and exe.loaded + exe.deferred == count  # the round's buckets, not the others
    keys = exe.deferred_keys()
    assert [math.prod(bucket) for _, bucket in keys] == sorted(math.prod(bucket) for _, bucket in keys)
    assert all(exe.ensure(*key) for key in keys) and exe.deferred == 0 and exe.loaded == count
    assert executables.cache_events()["backend_compiles"] == compiled_before
    np.testing.assert_allclose(scores, stored[1], atol=1e-6, rtol=0)  # a freshly compiled start's

    before = deferred_loaders()
    engine = Engine(settings)  # the engine's own loader: done, or ended by stop()
    engine.start()
    assert engine.timings["stored"] == count
    engine.stop(5)
    assert not deferred_loaders() - before


def deferred_loaders() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("scorefn-deferred")}


def test_a_changed_model_setting_misses_the_store(model_dir, cache_dir, tmp_path, stored):
    """The store is keyed by everything that shapes an executable: another dtype traces and compiles again (a float32
    start on the copied store loads every bucket; the first bfloat16 one, none)."""
    xla_dir = copy_of(stored, tmp_path)
    for dtype, held in (("float32", None), ("bfloat16", 0), ("bfloat16", None)):
        engine = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,), dtype=dtype,
                                       prefix_sharing=False))
        engine.start()
        engine.stop(5)
        assert engine.timings["stored"] == (engine.plan.count() if held is None else held)


def test_other_adapters_in_the_same_slots_load_every_bucket_from_the_store(model_dir, cache_dir, tmp_path):
    """LoRA adapters are parameters, not programs: a start with other adapters (the same SCOREFN_MAX_LORAS and
    SCOREFN_MAX_LORA_RANK) loads every executable the first start stored, and compiles nothing."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import peft_adapter

    base = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    peft_adapter(base, tmp_path / "one", 1, 8, ["q_proj", "down_proj"])
    peft_adapter(base, tmp_path / "two", 2, 4, ["v_proj", "up_proj"])
    xla_dir, slots = tmp_path / "xla", dict(batch_buckets=(2,), max_loras=2, max_lora_rank=8)
    first = Engine(small_settings(model_dir, cache_dir, xla_dir, lora_adapters=f"one={tmp_path / 'one'}", **slots))
    first.start()
    first.stop(5)
    assert first.timings["stored"] == 0
    second = Engine(small_settings(model_dir, cache_dir, xla_dir, **slots,
                                   lora_adapters=f"two={tmp_path / 'two'},one={tmp_path / 'one'}"))
    compiled_before = executables.cache_events()["backend_compiles"]
    second.start()
    try:
        assert second.timings["stored"] == second.plan.count()
        assert executables.cache_events()["backend_compiles"] == compiled_before
        sequences = [[5, 6, 7], [8, 9]]
        scores = {adapter: second.submit(sequences, [1, 2], adapter=adapter).result().logprobs
                  for adapter in (None, "one", "two")}
        assert second.adapters == ("two", "one") and not np.allclose(scores["two"], scores[None], atol=1e-3)
        assert not np.allclose(scores["two"], scores["one"], atol=1e-3)
    finally:
        second.stop(5)


def test_another_cpu_feature_class_misses_the_store(model_dir, cache_dir, tmp_path, monkeypatch, caplog):
    """XLA:CPU compiles for the host's features, and what it compiled may stop on an illegal instruction on a host
    without them: the store keys executables by the CPU feature class compiled for, so a start on a host of a lower
    class (injected: an AMX host, then an AVX2-only one) does not take a higher class's set, and says why."""
    xla_dir, cpuinfo = tmp_path / "xla", tmp_path / "cpuinfo"
    monkeypatch.setattr(platforms, "CPUINFO", cpuinfo)
    for host, stored in ((SAPPHIRE_RAPIDS, 0), (EPYC, 0), (SAPPHIRE_RAPIDS, None)):
        cpuinfo.write_text(host)
        engine = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,), prefix_sharing=False))
        engine.start()
        engine.stop(5)
        assert engine.timings["stored"] == (engine.plan.count() if stored is None else stored)
    assert 'differs in cpu "amx" stored, "avx2" here' in caplog.text


def test_a_start_takes_a_lower_classes_whole_set_with_its_format(model_dir, cache_dir, tmp_path, monkeypatch,
                                                                 caplog):
    """An image carries a baseline set (`scorefn warmup --cpu-class avx2`) beside its build host's: a start on a
    higher class whose own set is not stored takes the whole baseline set, in that class's format (float32),
    instead of compiling; a set the store holds only in part is not taken."""
    xla_dir, cpuinfo = tmp_path / "xla", tmp_path / "cpuinfo"
    monkeypatch.setattr(platforms, "CPUINFO", cpuinfo)
    settings = dict(batch_buckets=(2,), prefix_sharing=False, dtype="auto")
    cpuinfo.write_text(SAPPHIRE_RAPIDS)
    # The baseline set as `scorefn warmup --cpu-class avx2` compiles it on this AMX host: XLA_FLAGS caps the class
    # (this process's backend has started, so its code is the host's; the set is what such a build stores: portable
    # kernels, float32).
    with monkeypatch.context() as capped:
        capped.setenv("XLA_FLAGS", platforms.max_isa_flag("avx2"))
        baseline = Engine(small_settings(model_dir, cache_dir, xla_dir, **settings))
        baseline.start()
        baseline.stop(5)
    assert baseline.platform.dtype == "float32" and baseline.platform.cpu.feature_class == "avx2"
    engine = Engine(small_settings(model_dir, cache_dir, xla_dir, **settings))
    engine.start()
    try:
        assert engine.timings["stored"] == engine.plan.count()  # nothing compiled
        assert engine.platform.cpu.feature_class == "avx2" and engine.platform.dtype == "float32"
        assert "no executables for this host's CPU class amx; taking the whole set compiled for class avx2" \
            in caplog.text
        assert engine.score([[5, 6, 7]], [1, 2]).shape == (1, 2)
    finally:
        engine.stop(5)
    for path in list((xla_dir / "executables").glob("*/*.jaxexe"))[:1]:
        path.unlink()  # the baseline set no longer whole: the AMX host compiles its own (bfloat16)
    own = Engine(small_settings(model_dir, cache_dir, xla_dir, **settings))
    own.start()
    own.stop(5)
    assert own.platform.cpu.feature_class == "amx" and own.platform.dtype == "bfloat16"
    assert own.timings["stored"] == 0


def test_executables_from_the_persistent_cache_are_stored_with_the_caches_bytes(model_dir, cache_dir, tmp_path):
    """XLA:CPU cannot serialize an executable it loaded from the persistent cache (it loses its generated code), so
    the store keeps the cache's own bytes for it: a start that hit the cache fills the store, and the next one loads
    every bucket from the store alone (the cache gone), computing the same bits."""
    xla_dir = tmp_path / "xla"
    first = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,), prefix_sharing=False))
    first.start()
    expected = first.score([[5, 6, 7]], [1, 2])
    first.stop(5)
    store = xla_dir / "executables"
    assert len(list(store.glob("*/*.jaxexe"))) == first.plan.count()
    shutil.rmtree(store)
    second = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,), prefix_sharing=False))
    second.start()
    second.stop(5)
    assert second.timings["cache_hits"] == second.plan.count()
    assert len(list(store.glob("*/*.jaxexe"))) == second.plan.count()
    for cache in xla_dir.glob("cpu-*"):
        shutil.rmtree(cache)
    third = Engine(small_settings(model_dir, cache_dir, xla_dir, batch_buckets=(2,), prefix_sharing=False))
    third.start()
    try:
        assert third.timings["stored"] == third.plan.count() and third.timings["cache_hits"] == 0
        compiles = executables.cache_events()["backend_compiles"]
        assert np.array_equal(third.score([[5, 6, 7]], [1, 2]), expected)
        assert executables.cache_events()["backend_compiles"] == compiles  # every deferred bucket loaded, none compiled
    finally:
        third.stop(5)


ZEN4 = ("processor\t: 0\nmodel name\t: AMD EPYC 9B14 96-Core Processor\n"
        "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni\n")


def test_every_start_on_a_class_computes_in_the_same_format_and_bits(model_dir, cache_dir, tmp_path, monkeypatch):
    """The format is the class's (a fixed table), never a timing taken at start: with the matmul probe's figures
    drawn at random (as a noisy host times them: bfloat16 1.0-3.5x float32), twenty starts on an AVX512-BF16 host
    (injected) choose bfloat16 every time, none compiles what the store holds, and the same request gets the same
    bits from each."""
    monkeypatch.setattr(platforms, "CPUINFO", tmp_path / "cpuinfo")
    (tmp_path / "cpuinfo").write_text(ZEN4)
    rng = np.random.default_rng(0)
    monkeypatch.setattr(platforms, "matmul_probe",
                        lambda *a, **k: {"float32": 180.0, "bfloat16": 180.0 * rng.uniform(1.0, 3.5)})
    settings = small_settings(model_dir, cache_dir, tmp_path / "xla", dtype="auto", batch_buckets=(2,),
                              prefix_sharing=False)
    request = random_sequences(np.random.default_rng(1), 3, 2, 30, 49152)
    first = None
    for start in range(20):
        engine = Engine(settings)
        engine.start()
        try:
            assert engine.platform.dtype == "bfloat16" and engine.platform.cpu.feature_class == "avx512_bf16"
            assert engine.timings["stored"] == (0 if start == 0 else engine.plan.count())
            scores = engine.score(request, [1, 2, 3])
        finally:
            engine.stop(5)
        first = scores if first is None else first
        assert np.array_equal(scores, first), start
