"""The service model's first prices (runtime.assembly.calibration) on a tiny model: with two launcher threads, a
pair of batches is timed together and the model prices two lanes; with one, rounds are priced serially."""

from __future__ import annotations

import pytest

from runtime.assembly.calibration import calibrate
from runtime.requests.cost import Work
from runtime.requests.jobs import Job
from runtime.requests.prefix_cache import BLOCK, MIN_TOKENS, PrefixCache
from tests.runtime.conftest import scorer_for, small_plan, tiny_served


def calibrated(model_dir, threads: int):
    """The calibrated model, and the kinds of the jobs of every call calibration scored."""
    scorer = scorer_for(model_dir, plan=small_plan(completion_batches=(1, 8)), concurrent_batches=threads)
    calls, score_jobs = [], scorer.score_jobs
    scorer.score_jobs = lambda jobs: calls.append(tuple(type(job).__name__ for job in jobs)) or score_jobs(jobs)
    return calibrate(scorer), calls


def test_calibration_times_a_pair_where_the_scorer_runs_two_batches_at_once(tiny_llama_dir) -> None:
    two, calls = calibrated(tiny_llama_dir, 2)
    assert calls[-2:] == [("Job", "TokenJob")] * 2  # the big full bucket beside the completion bucket, twice
    # Their seconds together over each alone: a ratio of timings, in [1/2, 1] (a loaded host may read 1: no gain).
    assert two.lanes == 2 and 0.5 <= two.overlap <= 1.0
    assert two.seconds(Work(batches=2, full=256)) == pytest.approx(
        two.overlap * two.seconds(Work(batches=1, full=128)) * 2)

    one, calls = calibrated(tiny_llama_dir, 1)
    assert all(len(jobs) == 1 for jobs in calls)  # nothing timed together
    assert (one.lanes, one.overlap) == (1, 1.0)
    assert one.seconds(Work(batches=2, full=256)) == pytest.approx(one.seconds(Work(batches=1, full=128)) * 2)


def test_calibration_prices_full_buckets_with_the_prefix_cache_set_aside(tmp_path, embedded_dir) -> None:
    """A full bucket's row of MIN_TOKENS or more is kept by the prefix cache, and its second run was a hit: a cascade
    of no full tokens, and start-up divided by zero (a fast device reaches such a bucket before its step cap)."""
    length = MIN_TOKENS + 2 * BLOCK
    tiny_served("llama", tmp_path, embedded_dir, max_position_embeddings=2 * length)
    plan = small_plan(lengths=(16, length), batches=(1,), prefix_sharing=True, contexts=(length,),
                      suffix_lengths=(2 * BLOCK,), suffix_batches=(1,))
    scorer = scorer_for(tmp_path, plan=plan, concurrent_batches=1)
    scorer.prefix_cache = cache = PrefixCache(1 << 30)
    model = calibrate(scorer, grow_until=1e9, step_cap_s=1e9)  # up to the longest bucket, whatever the timings
    assert scorer.prefix_cache is cache and cache.stats()["prefix_cache_entries"] == 0
    assert scorer.cost([Job([[1] * length], [0])]).full == 0  # a row such calibration times: kept apart, in use
    assert model.seconds(Work(batches=1, full=length)) > model.seconds(Work(batches=1, full=16)) > 0
