"""Device rounds (runtime.requests.round_builder), through the scheduler in stepped time
(tests/runtime/requests/stepped.py): what each round takes, in what order and in which slices."""

from __future__ import annotations

import pytest

from runtime.interface import DeadlineExceeded
from runtime.requests.round_builder import MIN_WAIT_S, ROUND_BATCHES, ROUND_S, admission_limits
from tests.runtime.requests.stepped import job, run, scheduler, shared_cost


def test_rounds_take_the_shortest_work_first_and_slice_the_rest() -> None:
    s, clock = scheduler()
    s.admit(job(100, 128), None, "bulk")  # 100 rows of 0.125 s; a round holds 0.3 s
    s.admit(job(1, 64), None, "small")
    s.admit(job(3, 128), None, "medium")  # 0.375 s: longer than a round, shorter than the bulk request
    assert run(s, clock) == [("small", 0, 1), ("medium", 0, 1)]  # what fits of the next shortest
    assert run(s, clock) == [("medium", 1, 3)]  # less than half of the budget left: nothing longer is started
    assert run(s, clock) == [("bulk", 0, 2)]  # alone: as many rows as fit the budget
    s.admit(job(1, 32), None, "late")
    assert run(s, clock) == [("late", 0, 1), ("bulk", 2, 4)]  # a new small request never waits for the bulk one
    assert run(s, clock) == [("bulk", 4, 6)]


def test_the_oldest_request_moves_on_however_much_shorter_work_arrives() -> None:
    s, clock = scheduler()
    s.admit(job(40, 128), None, "bulk")  # 5 s
    with_bulk = []
    for i in range(30):  # a stream of shorter requests, each 0.25 s: less than half of a round is left beside it
        s.admit(job(2, 128), None, f"small-{i}")
        with_bulk += [i] if any(request == "bulk" for request, _, _ in run(s, clock)) else []
    # its share of the device (a ninth of the others' time: 0.028 s a round) buys a one-row slice (0.125 s) in 4.5
    assert with_bulk == [4, 8, 13, 17, 22, 26]


def test_requests_past_their_deadline_or_cancelled_are_not_computed() -> None:
    s, clock = scheduler()
    late = s.admit(job(1), clock.now + 0.5, "late")
    gone = s.admit(job(1), None, "gone")
    kept = s.admit(job(1), None, "kept")
    assert gone.cancel()
    clock.now += 1
    assert run(s, clock) == [("kept", 0, 1)]
    assert isinstance(late.exception(0), DeadlineExceeded) and kept.running()


def test_a_request_that_has_waited_half_its_deadline_starts_in_the_next_round() -> None:
    s, clock = scheduler()
    bulk = s.admit(job(100, 128), clock.now + 10, "bulk")
    run(s, clock)  # started: never dropped for its deadline from now on
    waiting = s.admit(job(50, 128), clock.now + 10, "waiting")  # longer than what is left of the first
    clock.now += 5.01  # half of its time to the deadline gone without a slice
    assert run(s, clock)[0][0] == "waiting"
    clock.now += 10
    run(s, clock)
    assert not waiting.done() and not bulk.done()  # both are started: neither is dropped


def test_a_slice_amortizes_its_shared_prefix_and_its_device_batch() -> None:
    s, _ = scheduler(cost=shared_cost)
    s.admit(job(200), None, "shared")  # its prefix costs as much as 5 rows: slices of at least 5
    (piece,) = s.next_round().slices
    assert piece.stop - piece.start >= 5 and piece.work.context == 50, "every slice computes its prefix once"
    assert piece.job.sequences == job(200).sequences[piece.start:piece.stop]
    priced, _ = scheduler(per_batch=0.25)  # a device batch costs as much as two rows of 128 tokens
    priced.admit(job(100, 128), None, "bulk")
    assert priced.rounds._smallest(priced.backlog.queue[0]) == 4  # so a slice holds at least 4 rows: the batch adds at most half


def test_automatic_limits_give_a_round_the_price_of_a_few_device_batches():
    """SCOREFN_MAX_WAIT_S and SCOREFN_MAX_ROUND_S auto: from the start's price of a device batch; as set otherwise."""
    assert admission_limits(None, None, per_batch_s=0.01) == (MIN_WAIT_S, ROUND_S[0])  # a GPU: 2 s and 0.3 s
    wait, round_ = admission_limits(None, None, per_batch_s=0.15)  # a 2-core AVX2 EPYC's batch: ~0.15-0.25 s
    assert round_ == pytest.approx(ROUND_BATCHES * 0.15) and wait == pytest.approx(4 * round_)
    assert admission_limits(None, None, per_batch_s=5.0) == (4 * ROUND_S[1], ROUND_S[1])
    assert admission_limits(1.0, None, per_batch_s=0.15)[0] == 1.0 and admission_limits(None, 0.5, 9.0) == (2.0, 0.5)
