"""Device batches launched from two threads (runtime.requests.launch; the CPU platform's default is one until
admission prices rounds of two) give the bits of one thread on every path a round takes, name the programs they ran
in the same order, and raise a batch's error where the round is collected; a bucket first run from two threads at
once compiles once."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.interface import Sampling
from runtime.requests.jobs import Job, TokenJob, label_rows
from runtime.requests.launch import MAX_CPU_THREADS, Launcher, cpu_threads
from runtime.requests.scorer import Scorer
from tests.runtime.conftest import random_sequences, scorer_for, small_plan

pytestmark = pytest.mark.slow
VOCAB = 49152
PLAN = small_plan(lengths=(32, 64), batches=(1, 4), prefix_sharing=True, suffix_lengths=(8, 32), suffix_batches=(4,),
                  completion_batches=(4,), labels=(4,), contexts=(32, 64))


def round_of_every_path() -> list:
    """One round: whole sequences (3 device batches), items after a shared prefix (3 more), labels of several
    tokens after a shared prefix, and per-position log-probabilities (2 batches)."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, VOCAB, 40).tolist()
    return [Job(random_sequences(rng, 11, 1, 60, VOCAB), [7042, 4528, 11]),
            Job([prefix + item for item in random_sequences(rng, 9, 1, 20, VOCAB)], [7042, 4528, 11, 0]),
            label_rows([prefix + [330, 28]], [[7042], [4528, 11, 907], [282, 5]]),
            TokenJob(random_sequences(rng, 6, 2, 60, VOCAB), [Sampling()] * 6)]


def test_two_launcher_threads_give_the_bits_of_one(embedded_shaped_dir):
    scorer = scorer_for(embedded_shaped_dir, "bfloat16", PLAN)
    one, two = Scorer(PLAN, scorer.exe, 1), Scorer(PLAN, scorer.exe, 2)
    jobs = round_of_every_path()
    dispatched = {threads: s.dispatch(jobs) for threads, s in ((1, one), (2, two))}
    results = {threads: s.collect(dispatched[threads]) for threads, s in ((1, one), (2, two))}
    for ours, theirs in zip(results[2][:3], results[1][:3], strict=True):
        assert np.array_equal(ours, theirs)
    for ours, theirs in zip(results[2][3], results[1][3], strict=True):
        for field in ("next_logprobs", "top_ids", "top_logprobs", "next_id", "next_logprob"):
            assert np.array_equal(getattr(ours, field), getattr(theirs, field)), field
    assert dispatched[2].buckets == dispatched[1].buckets
    programs = {bucket.partition("[")[0] for bucket in dispatched[2].buckets}
    assert {"prefill_context", "hidden_after_context", "hidden", "label_logprobs", "token_logprobs"} <= programs
    assert two.device_batches == one.device_batches == 3 + 3 + 1 + 2


def test_a_bucket_first_run_from_two_threads_compiles_once(embedded_shaped_dir):
    scorer = scorer_for(embedded_shaped_dir, "bfloat16", PLAN, concurrent_batches=2)
    rng = np.random.default_rng(6)
    scorer.score(random_sequences(rng, 16, 20, 30, VOCAB), [7042])  # 4 batches of one bucket, then its head
    assert scorer.exe.compiles == 2


def test_a_batch_that_fails_raises_where_the_round_is_collected():
    def programs(program, bucket, *args):
        raise RuntimeError(f"{program}{list(bucket)} failed")
    launched = Launcher(programs, threads=2).launch(lambda run: [(run("hidden", (4, 32)), [])])
    with pytest.raises(RuntimeError, match=r"hidden\[4, 32\] failed"):
        launched.entries()
    assert launched.programs == ["hidden[4, 32]"]


def test_the_cpu_runs_at_most_a_batch_a_core_at_once():
    assert [cpu_threads(cores) for cores in (1, 2, 64)] == [1, min(2, MAX_CPU_THREADS), MAX_CPU_THREADS]
