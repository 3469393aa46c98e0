"""Admission (runtime.requests.admission), through the scheduler in stepped time (tests/runtime/requests/stepped.py):
which requests are queued, which refused and with what Retry-After."""

from __future__ import annotations

import pytest

from runtime.interface import Prediction, QueueFull
from runtime.requests.cost import ServiceModel, Work
from runtime.requests.scheduler import Scheduler
from tests.runtime.requests.stepped import SECONDS_PER_TOKEN, Clock, full_cost, job, scheduler


def test_a_small_request_is_admitted_while_it_would_be_answered_within_the_budget() -> None:
    s, _ = scheduler()
    for _ in range(16):  # 0.125 s each, alike ones in order: the 16th waits 1.875 s and is done at 2 s
        s.admit(job(1, 128), None, None)
    with pytest.raises(QueueFull) as refused:
        s.admit(job(1, 128), None, "seventeenth")
    assert "wait 2.0 s" in str(refused.value) and "SCOREFN_MAX_WAIT_S" in str(refused.value)
    assert refused.value.reason == "wait" and refused.value.retry_after_s == 1  # ceil(0.125 s over)
    assert refused.value.predicted == Prediction(queue_seconds=2.0, device_seconds=0.125)
    assert s.stats()["refused_wait"] == 1 and s.stats()["queue_depth"] == 16


def test_a_large_request_is_never_refused_for_its_size_and_small_ones_do_not_wait_for_it() -> None:
    s, _ = scheduler()
    s.admit(job(200, 128), None, "bulk")  # 25 s of work: admitted on an idle instance
    assert s.stats()["backlog_seconds"] == 25.0
    assert s.stats()["predicted_wait_seconds"] == 0.0  # shorter work goes first: a small request does not wait for it
    for _ in range(14):
        s.admit(job(1, 128), None, None)
    s.admit(job(200, 128), None, "second bulk")  # it waits for the first and the small ones, still before its deadline
    assert s.stats()["queue_depth"] == 16


def test_under_overload_requests_of_every_size_are_refused_alike_and_bursts_below_it_are_not() -> None:
    s, clock = scheduler(max_wait_s=1.0)
    for _ in range(20):  # a burst of 20 requests of 8 s, each counted as 1 s (the budget): 20 s asked for in 30 s
        s.admit(job(8, 1024), clock.now + 1000, None)
    assert s.stats()["load"] == pytest.approx(20 / 30) and s.stats()["queue_depth"] == 20  # queued, not refused
    for _ in range(10):  # another 10 s asked for: the instance is asked for as much as it computes
        s.admit(job(8, 1024), clock.now + 1000, None)
    small = job(1, 8)
    with pytest.raises(QueueFull) as refused:  # overloaded, and a backlog of 240 s is over 4 x the budget
        s.admit(small, None, "small")
    assert refused.value.reason == "overload" and "overloaded" in str(refused.value)
    assert refused.value.retry_after_s == 236  # all the work admitted and not done counts: 240 s, 4 s allowed
    load = s.stats()["load"]
    with pytest.raises(QueueFull, match="overloaded"):  # sent again: it counts once in the offered load
        s.admit(job(1, 8), None, "small again")
    assert s.stats()["load"] == pytest.approx(load)
    with pytest.raises(QueueFull, match="overloaded"):  # whatever its size
        s.admit(job(8, 1024), clock.now + 1000, None)
    assert s.stats()["load"] > load
    clock.now += 30  # the offered load decays below capacity: a request is queued again
    assert s.stats()["load"] < 1
    s.admit(small, None, "small")
    assert s.stats()["refused_overload"] == 3


def test_the_queue_length_stays_a_hard_cap() -> None:
    s, _ = scheduler(max_queue=3)
    for _ in range(3):
        s.admit(job(1, 1), None, None)
    with pytest.raises(QueueFull) as refused:
        s.admit(job(1, 1), None, None)
    assert "SCOREFN_MAX_QUEUE" in str(refused.value) and refused.value.retry_after_s >= 1
    assert s.stats()["refused_queue"] == 1


def test_a_request_that_would_start_past_its_deadline_is_refused() -> None:
    s, clock = scheduler()
    s.admit(job(1, 1024), None, None)  # 1 s queued
    with pytest.raises(QueueFull, match="past its deadline") as refused:  # would start after its deadline
        s.admit(job(2, 1024), clock.now + 0.5, None)
    assert refused.value.reason == "deadline"


def test_a_small_request_that_can_no_longer_start_in_time_is_refused_at_once() -> None:
    """Rounds slower than predicted: the small requests queued that the next round could only start after their
    SCOREFN_MAX_WAIT_S are refused (429, Retry-After) when a round is taken, not answered late."""
    s, clock = scheduler()
    futures = [s.admit(job(1, 128), None, f"r{i}") for i in range(16)]  # 2 s of work, admitted on the promise
    started = {}
    while s.stats()["queue_depth"]:
        round = s.next_round()
        started |= {piece.entry.request_id: clock.now - 1000.0 for piece in round.slices}
        clock.now += 2 * round.predicted_s  # the device runs at half the predicted speed
        s.finish(round)
    late = [f for f in futures if f.done() and isinstance(f.exception(), QueueFull)]
    assert late and all(f.exception().reason == "late" and f.exception().retry_after_s >= 1 for f in late)
    assert "could not start within 2 s (SCOREFN_MAX_WAIT_S)" in str(late[0].exception())
    assert s.stats()["refused_late"] == len(late) == 16 - len(started)
    # Every request computed started within SCOREFN_MAX_WAIT_S, but for the overrun of the round before it (the
    # round a refusal is decided beside overran its prediction too): within one round budget more.
    assert max(started.values()) <= 2.0 + s.round_s


def drain(s: Scheduler, clock: Clock) -> None:
    """Run the queued work to the end, each round taking its predicted time."""
    while s.stats()["queue_depth"]:
        round = s.next_round()
        clock.now += round.predicted_s
        s.finish(round)


def admitted(s: Scheduler, make=lambda: job(1, 128)) -> int:
    """How many requests are queued before the first refusal."""
    count = 0
    while True:
        try:
            s.admit(make(), None, None)
        except QueueFull:
            return count
        count += 1


def twice_the_price(jobs) -> Work:
    """Rounds whose planned cost is twice their slices' price (small rows that do not fill their device batches)."""
    return sum((full_cost(j) for j in jobs), Work()) * 2


def test_the_promise_counts_the_work_ahead_at_what_busy_rounds_really_cost() -> None:
    """The wait promised to a small request counts the queued work at what rounds cost while work waits behind them,
    so fewer are admitted."""
    clock = Clock()
    priced = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, 0.3, clock=clock)
    packed = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, 0.3, clock=clock,
                       round_cost=twice_the_price)
    for s in (priced, packed):
        for _ in range(30):  # bursts of 4: the first round of each leaves work queued behind it, and teaches `packing`
            for _ in range(4):
                s.admit(job(1, 128), None, None)
            drain(s, clock)
    assert admitted(priced) == 16 and 7 <= admitted(packed) <= 9  # 2 s at the price, ~2 s at twice it


def test_a_request_alone_never_waits_for_its_own_work_and_lone_rounds_teach_no_packing() -> None:
    """Issue 65: an idle server refused a request whose own work, at the packing its lone rounds had taught, looked
    like a wait. Its own work (its device batches alone: twice its share here) is its service time, never a wait."""
    clock = Clock()
    s = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, 0.3, clock=clock,
                  round_cost=twice_the_price)
    for _ in range(50):  # the same request, one after another on an idle server
        s.admit(job(1, 512), None, None)  # 0.5 s at its price, 1 s alone: small, at the edge; never refused
        drain(s, clock)
    assert s.stats()["packing"] == 1.0  # no round had work waiting behind it
    assert admitted(s) == 15  # a burst is judged at its rounds' cost (0.125 s at its price, 0.25 s alone)


@pytest.mark.parametrize("rows, tokens", [(1, 1024), (3, 1024), (40, 1024), (1024, 64)])
def test_an_idle_instance_admits_every_request_whatever_its_size(rows, tokens) -> None:
    """1 s, 3 s, 40 s (over SCOREFN_MAX_WAIT_S and the deadline's 30 s) and 64 s of work alone: each is admitted on an
    idle instance, with its own work predicted and no wait, and computed to its end."""
    s, clock = scheduler()
    future = s.admit(job(rows, tokens), clock.now + 30, "alone")
    entry = s.backlog.queue[0]
    assert entry.future is future and entry.admission.own_s == rows * tokens / 1024 and entry.admission.wait_s == 0
    drain(s, clock)
    assert clock.now - 1000.0 == pytest.approx(rows * tokens / 1024)  # every row computed


def test_a_client_that_retries_as_told_is_answered() -> None:
    """A refusal's Retry-After is the wait until the work ahead has drained enough: a client that honours it, on an
    instance given no other work meanwhile, is admitted at its first retry."""
    s, clock = scheduler()
    for _ in range(15):  # 1.875 s of small work queued
        s.admit(job(1, 128), None, None)
    refused = None
    for tries in range(1, 5):
        try:
            future = s.admit(job(2, 256), None, "retrying")  # 0.5 s of its own: needs the queue under 1.5 s
            break
        except QueueFull as error:
            refused = error
            until = clock.now + error.retry_after_s
            while clock.now < until and s.stats()["queue_depth"]:  # the device works while the client waits
                round = s.next_round()
                clock.now += round.predicted_s
                s.finish(round)
            clock.now = max(clock.now, until)
    assert refused is not None and refused.reason == "wait" and tries == 2 and not future.done()
