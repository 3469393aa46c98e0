"""SCOREFN_READY=first: a start that finds nothing stored is ready once the smallest bucket of each program (and those
its timing runs) is compiled; the others are compiled after ready on the start's background thread, smallest first,
and stored. A request that needs one waits for it (taken next), never compiling on its own thread, and gets the bits
of a start that compiled everything first."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.engine import Engine
from tests.runtime.assembly.test_warmup import small_settings
from tests.runtime.conftest import random_sequences

pytestmark = pytest.mark.slow

LENGTHS, BATCHES = (16, 32), (1, 4)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def settings(model_dir, cache_dir, xla_dir, ready):
    return small_settings(model_dir, cache_dir, xla_dir, length_buckets=LENGTHS, batch_buckets=BATCHES, ready=ready)


class Recording(Engine):
    """An engine that records the thread of every compile after ready."""

    def start_with(self, scorer, service=None) -> None:
        self.compiled_on: list[str] = []
        add = scorer.exe.add

        def recording(name, bucket, lowered):
            self.compiled_on.append(threading.current_thread().name)
            return add(name, bucket, lowered)
        scorer.exe.add = recording
        super().start_with(scorer, service)


def test_a_cold_start_is_ready_after_its_first_buckets_and_compiles_the_rest_after(model_dir, cache_dir, tmp_path):
    reference = Engine(settings(model_dir, cache_dir, tmp_path / "all", "all"))
    reference.start()
    sequences = random_sequences(np.random.default_rng(0), 6, 20, 32, 49152)  # batches of 4 at length 32
    try:
        assert reference.timings["pending"] == 0
        expected = reference.score(sequences, [1, 2, 3])
    finally:
        reference.stop(5)

    engine = Recording(settings(model_dir, cache_dir, tmp_path / "first", "auto"))  # nothing stored: first
    engine.start()
    try:
        exe = engine.scorer.exe
        assert engine.timings["pending"] > 0 and engine.timings["buckets"] == engine.plan.count()
        # A request whose largest bucket is still pending (compiled smallest first, so among the last): it waits for
        # its compile, taken next, and gets the bits of a start that compiled everything first
        assert not exe.has("hidden", (4, 32))
        assert np.array_equal(engine.score(sequences, [1, 2, 3]), expected)
        assert engine.wait_settled(300)
        assert exe.pending == 0 and all(exe.has(program.name, bucket) for program, bucket in
                                        engine.plan.programs(engine.task))
        assert engine.compiled_on and all(name.startswith("scorefn-deferred") for name in engine.compiled_on)
    finally:
        engine.stop(5)

    again = Engine(settings(model_dir, cache_dir, tmp_path / "first", "auto"))  # all stored after ready: all
    again.start()
    try:
        assert again.timings["pending"] == 0 and again.timings["stored"] == again.plan.count()
        assert np.array_equal(again.score(sequences, [1, 2, 3]), expected)
    finally:
        again.stop(5)
