"""The service model's first prices (runtime.assembly.calibration) on a tiny model: with two launcher threads, the
overlap of two batches run at once is measured; with one, rounds are priced serially."""

from __future__ import annotations

import pytest

from runtime.assembly.calibration import calibrate
from runtime.requests.cost import Work
from tests.runtime.conftest import scorer_for, small_plan


def test_calibration_measures_two_lanes_where_the_scorer_runs_two_batches_at_once(tiny_llama_dir) -> None:
    plan = small_plan(completion_batches=(1, 8))
    two = calibrate(scorer_for(tiny_llama_dir, plan=plan, concurrent_batches=2))
    assert two.lanes == 2
    # A ratio of timings (the pair's partner is the completion batch, never put in one batch with a full one).
    assert 0.5 <= two.overlap <= 1.0 and two.overlap != 1.0
    assert two.seconds(Work(batches=2, full=256)) < two.seconds(Work(batches=1, full=128)) * 2
    one = calibrate(scorer_for(tiny_llama_dir, plan=plan, concurrent_batches=1))
    assert (one.lanes, one.overlap) == (1, 1.0)
    assert one.seconds(Work(batches=2, full=256)) == pytest.approx(one.seconds(Work(batches=1, full=128)) * 2)
