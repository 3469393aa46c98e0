"""Admission and device rounds (runtime.requests.scheduler), and the engine's rounds around it. A stepped clock and a
known service model: no device, no sleeps."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from runtime.interface import DeadlineExceeded, Prediction, QueueFull
from runtime.requests.cost import KINDS, ServiceModel, Work
from runtime.engine import Engine
from runtime.requests.scheduler import Scheduler
from runtime.settings import load_settings

SECONDS_PER_TOKEN = dict.fromkeys(KINDS, 1 / 1024)  # binary fractions: exact sums


@dataclasses.dataclass(frozen=True)
class Job:
    sequences: list
    label_ids: tuple = (0,)


def job(rows: int, tokens: int = 10) -> Job:
    return Job([[1] * tokens] * rows)


def full_cost(job: Job) -> Work:
    return Work(batches=0, full=sum(map(len, job.sequences)))


def shared_cost(job: Job) -> Work:
    """As if every row shared a 50-token prefix and had 10 tokens after it."""
    return Work(batches=1, context=50) + Work(continuation=10) * len(job.sequences)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(cost=full_cost, max_wait_s: float = 2.0, max_queue: int = 256, per_batch: float = 0.0
              ) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(ServiceModel(per_batch, SECONDS_PER_TOKEN), cost, max_queue, max_wait_s,
                     load_settings(environ={}).max_round_s, clock=clock), clock


def run(s: Scheduler, clock: Clock) -> list[tuple[str | None, int, int]]:
    """Take one round and let it take its predicted time; its (request id, first row, end row) slices."""
    round = s.next_round()
    clock.now += round.predicted_s
    s.finish(round)
    return [(piece.entry.request_id, piece.start, piece.stop) for piece in round.slices]


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


def test_requests_past_their_deadline_or_cancelled_are_not_computed() -> None:
    s, clock = scheduler()
    late = s.admit(job(1), clock.now + 0.5, "late")
    gone = s.admit(job(1), None, "gone")
    kept = s.admit(job(1), None, "kept")
    assert gone.cancel()
    clock.now += 1
    assert run(s, clock) == [("kept", 0, 1)]
    assert isinstance(late.exception(0), DeadlineExceeded) and kept.running()
    s.admit(job(1, 1024), None, None)  # 1 s queued
    with pytest.raises(QueueFull, match="past its deadline") as refused:  # would start after its deadline
        s.admit(job(2, 1024), clock.now + 0.5, None)
    assert refused.value.reason == "deadline"


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
    assert priced._smallest(priced._queue[0]) == 4  # so a slice holds at least 4 rows: the batch adds at most half


class RowScorer:
    """A stub device: each row scores minus its first token (a mix-up of slices shows), a held gate stalls a round."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.rounds: list[list[tuple[int, int]]] = []  # per round: (first token of the first row, rows) per job

    @staticmethod
    def cost(jobs, marginal: bool = False) -> Work:
        return Work(full=sum(len(seq) for job in jobs for seq in job.sequences))

    @staticmethod
    def slice_rows(job) -> int:
        return 1

    def dispatch(self, jobs) -> list[np.ndarray]:
        self.rounds.append([(job.sequences[0][0], len(job.sequences)) for job in jobs])
        self.entered.set()
        assert self.gate.wait(30)
        return [np.array([[-float(sequence[0])] for sequence in job.sequences], np.float32) for job in jobs]

    def collect(self, results: list[np.ndarray]) -> list[np.ndarray]:
        return results


def test_the_engine_answers_small_requests_between_the_slices_of_a_large_one() -> None:
    engine = Engine(load_settings(environ={}, batch_wait_ms=0.0))
    scorer = RowScorer()
    engine.start_with(scorer, ServiceModel(0.0, SECONDS_PER_TOKEN))
    done: list[str] = []
    try:
        blocker = engine.submit([[7] * 8], [0])
        assert scorer.entered.wait(30)  # the device is busy: what follows queues
        bulk = engine.submit([[1000 + row] * 128 for row in range(40)], [0])  # 5 s: sliced
        small = [engine.submit([[i] * 64], [0]) for i in range(3)]
        bulk.add_done_callback(lambda _: done.append("bulk"))
        for i, future in enumerate(small):
            future.add_done_callback(lambda _, i=i: done.append(f"small-{i}"))
        scorer.gate.set()
        assert bulk.result(30).logprobs[:, 0].tolist() == [-1000.0 - row for row in range(40)]
        assert [f.result(30).logprobs.tolist() for f in small] == [[[0.0]], [[-1.0]], [[-2.0]]]
        assert blocker.result(30).logprobs.tolist() == [[-7.0]]
        assert small[0].result().predicted.device_seconds == 0.0625  # what admission predicted comes back too
    finally:
        scorer.gate.set()
        engine.stop(5)
    assert done[-1] == "bulk" and sorted(done[:3]) == ["small-0", "small-1", "small-2"]
    bulk_rounds = [r for r in scorer.rounds if any(first >= 1000 for first, _ in r)]
    assert len(bulk_rounds) >= 3 and [first for first, _ in scorer.rounds[1][:3]] == [0, 1, 2]


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


def test_the_promise_counts_the_work_ahead_at_what_rounds_really_cost() -> None:
    """Rounds whose planned cost is twice their slices' price (small rows that do not fill their device batches):
    the wait promised to a small request counts the queued work at that cost, so fewer are admitted."""
    clock = Clock()
    priced = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, 0.3, clock=clock)
    packed = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, 0.3, clock=clock,
                       round_cost=lambda jobs: sum((full_cost(j) for j in jobs), Work()) * 2)
    for s in (priced, packed):
        for _ in range(30):  # rounds that teach `packing`
            s.admit(job(1, 128), None, None)
            round = s.next_round()
            clock.now += round.predicted_s
            s.finish(round)

    def admitted(s: Scheduler) -> int:
        count = 0
        while True:
            try:
                s.admit(job(1, 128), None, None)
            except QueueFull:
                return count
            count += 1
    assert admitted(priced) == 16 and 7 <= admitted(packed) <= 9  # 2 s at the price, ~2 s at twice it
