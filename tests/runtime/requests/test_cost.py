"""What device work costs (runtime.requests.cost): the work the plan makes of requests, the service model that predicts
its seconds and learns them from rounds, and the plan's price of a device batch."""

from __future__ import annotations

import pytest

from runtime.interface import Sampling
from runtime.shapes.buckets import BucketPlan
from runtime.requests.cost import KINDS, ServiceModel, Work, plan_work, shared_slice_rows
from runtime.shapes.grid import GridLayout
from runtime.requests.jobs import Job, TokenJob

PLAN = BucketPlan(lengths=(32, 64), max_tokens=4096, labels=(4,), context_lengths=(32,), prefix_sharing=True,
                  layout=GridLayout((1, 4, 16), (8,), (4,)), completion_batches=(1, 4))


def test_the_work_of_requests_as_the_plan_splits_them():
    query = list(range(100, 120))
    full = Job([[i] + [1] * 29 for i in range(5)], [0])  # 5 rows of 30 tokens: batches of 4 and 1 at length 32
    assert plan_work(PLAN, [full]) == Work(batches=2, full=5 * 32)
    shared = Job([query + [i] for i in range(8)], [0])  # a 20-token prefix, 8 one-token items in two batches of 4
    assert plan_work(PLAN, [shared]) == Work(batches=3, context=32, continuation=2 * 4 * 8)
    tokens = TokenJob([[1] * 10] * 2, [Sampling()] * 2)  # two batches of 1 pad less than one of 4
    assert plan_work(PLAN, [tokens]) == Work(batches=2, completion=2 * 32)
    # on a busy device a row pays its share of the largest batch at its length
    assert plan_work(PLAN, [full], marginal=True) == Work(batches=(4 + 1) / 16, full=5 * 32)
    assert shared_slice_rows(PLAN, shared) == 4 and shared_slice_rows(PLAN, full) == 1


def test_requests_after_one_context_read_it_once_in_common_device_batches():
    query = list(range(100, 120))
    first, second = (Job([query + [j, i] for j in range(3)], [0]) for i in range(2))
    # one 20-token context, six two-token items in two batches of 4; alone, each computes it
    assert plan_work(PLAN, [first, second]) == Work(batches=3, context=32, continuation=2 * 4 * 8)
    assert plan_work(PLAN, [first]) == Work(batches=2, context=32, continuation=4 * 8)
    other_salt = Job(second.sequences, [0], cache_salt="b")
    assert plan_work(PLAN, [first, other_salt]) == Work(batches=4, context=2 * 32, continuation=2 * 4 * 8)
    # after a cached context, on a busy device, the items pay their share of the largest batch (4 rows)
    def cached(job, limit):
        return 20
    assert plan_work(PLAN, [first], cached=cached) == Work(batches=1, continuation=4 * 8)
    assert plan_work(PLAN, [first], marginal=True, cached=cached) == Work(batches=3 / 4, continuation=3 * 8)


TRUE_PRICES = {"full": 1.5e-3, "context": 1e-3, "continuation": 2e-3, "completion": 2e-3}
ROUNDS = [Work(batches=1, full=32), Work(batches=4, full=2048), Work(batches=2, context=512, continuation=256),
          Work(batches=1, completion=256), Work(batches=3, full=256, continuation=1024)]


def learned(lanes: int = 1, overlap: float = 1.0) -> tuple[ServiceModel, ServiceModel]:
    """A device's true model and one learned from 60 passes over ROUNDS, seeded poorly (4x the batch price, a third
    of the tokens')."""
    true = ServiceModel(0.05, TRUE_PRICES, lanes, overlap)
    model = ServiceModel(0.2, dict.fromkeys(KINDS, 0.5e-3), lanes, overlap)
    for _ in range(60):
        for work in ROUNDS:
            model.observe(work, true.seconds(work))
    return true, model


def test_the_service_model_learns_the_device_from_rounds() -> None:
    true, model = learned()
    for work in ROUNDS + [Work(batches=10, full=320), Work(batches=1, completion=2048, full=64)]:
        assert model.seconds(work) == pytest.approx(true.seconds(work), rel=0.15)
    before = model.seconds(ROUNDS[0])
    model.observe(ROUNDS[0], 100.0)  # one round slowed by something else moves the estimate a little
    assert model.seconds(ROUNDS[0]) < 1.6 * before


def test_a_start_whose_timings_told_no_batch_price_learns_it_from_rounds_of_two_sizes() -> None:
    """Issue 65: a start timed on a busy host charged everything to the tokens (a batch priced at 0): a one-item round
    looked 3x cheaper than it is and a 16-row one 2x dearer, so bursts were refused. Rounds of one and of 16 rows
    tell the two prices apart."""
    true = ServiceModel(0.145, dict.fromkeys(KINDS, 1 / 1571))
    model = ServiceModel(1e-9, dict.fromkeys(KINDS, 1 / 437))
    alone, burst = Work(batches=1, full=24), Work(batches=1, full=16 * 24)
    for _ in range(5):
        for work in (alone, burst):
            model.observe(work, true.seconds(work))
    for work in (alone, burst, Work(batches=1, full=4 * 24), Work(batches=2, full=2 * 32 * 24)):
        assert model.seconds(work) == pytest.approx(true.seconds(work), rel=0.05)
    assert model.per_batch == pytest.approx(0.145, rel=0.05)


def test_a_device_that_slows_down_is_priced_as_slow_within_a_window_of_rounds() -> None:
    true, model = learned()
    for _ in range(ServiceModel.WINDOW // len(ROUNDS) + 1):  # a neighbour halves the device's speed
        for work in ROUNDS:
            model.observe(work, 2 * true.seconds(work))
    for work in ROUNDS:
        assert model.seconds(work) == pytest.approx(2 * true.seconds(work), rel=0.05)


def test_two_lanes_price_a_round_by_its_batches_run_two_at_a_time() -> None:
    """Two batches at once in `overlap` of their serial seconds, one alone in all of its own: a round of 3 is a pair
    and one; a share of a batch (a slice's marginal price) is priced alone; one lane never overlaps."""
    one, two = (ServiceModel(0.1, dict.fromkeys(KINDS, 1e-3), lanes, overlap=0.8) for lanes in (1, 2))
    assert [two.lanes_factor(n) for n in (0.5, 1, 2, 3, 4)] == pytest.approx([1, 1, 0.8, (1.6 + 1) / 3, 0.8])
    assert two.lanes_factor(1.5) == pytest.approx((1 + 0.5 * 0.6) / 1.5)  # between a batch alone and a pair
    assert [one.lanes_factor(n) for n in (0.5, 2, 3)] == [1, 1, 1]
    pair = Work(batches=2, full=512)
    assert two.seconds(pair) == pytest.approx(0.8 * one.seconds(pair))
    assert ServiceModel(0.1, dict.fromkeys(KINDS, 1e-3), 2, overlap=0.1).overlap == 0.5  # never faster than both free

    # Serial prices learned from rounds of 1-4 batches on a two-lane device: a batch alone is priced right too.
    true, model = learned(lanes=2, overlap=0.85)
    for work in ROUNDS + [Work(batches=1, full=512), Work(batches=2, full=64, completion=2048)]:
        assert model.seconds(work) == pytest.approx(true.seconds(work), rel=0.15)


def test_the_plan_prices_a_device_batch_in_tokens_from_the_service_model() -> None:
    from runtime.shapes.buckets import BucketPlan
    from runtime.shapes.grid import GridLayout

    plan = BucketPlan(lengths=(64,), max_tokens=4096, labels=(4,), context_lengths=(64,), prefix_sharing=False,
                      layout=GridLayout((1, 4, 16), (8,), (8,)))
    assert ServiceModel(0.05, dict.fromkeys(KINDS, 1e-3)).fit_plan(plan).batch_overhead_tokens == pytest.approx(50)
    assert ServiceModel.neutral().fit_plan(plan).batch_overhead_tokens == pytest.approx(100)
    assert ServiceModel(1e-12, dict.fromkeys(KINDS, 1e-3)).fit_plan(plan) is plan  # no price told apart: unchanged
    # 13 rows of 64 tokens: three batches of 4 and one of 1 cost less than one batch of 16 padded by 3 rows
    assert [c.head_batch for c in ServiceModel(0.05, dict.fromkeys(KINDS, 1e-3)).fit_plan(plan).split_full([64] * 13)] \
        == [4, 4, 4, 1]
