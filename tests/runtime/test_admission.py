"""Admission by predicted wait and round-robin rounds (runtime.serving.scheduler), and the service model that
predicts device seconds (runtime.serving.cost). A stepped clock and a known model: no device, no sleeps."""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest

from runtime.interface import DeadlineExceeded, QueueFull
from runtime.serving.cost import KINDS, ServiceModel, Work
from runtime.serving.engine import Engine
from runtime.serving.scheduler import Scheduler
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


def scheduler(cost=full_cost, max_wait_s: float = 2.0, max_queue: int = 256) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), cost, max_queue, max_wait_s, clock=clock), clock


def rows_by_request(round) -> list[tuple[int, int, int]]:
    return [(id(piece.entry), piece.start, piece.stop) for piece in round.slices]


def test_requests_are_admitted_while_their_predicted_wait_fits_the_budget() -> None:
    s, _ = scheduler()
    for _ in range(16):  # 0.125 s each: the 16th waits 1.875 s and is done at 2 s
        s.admit(job(1, 128), None, None)
    with pytest.raises(QueueFull) as refused:
        s.admit(job(1, 128), None, "seventeenth")
    assert "wait 2.0 s" in str(refused.value) and "SCOREFN_MAX_WAIT_S" in str(refused.value)
    assert refused.value.retry_after_s == 1  # ceil(0.125 s over)
    assert s.stats()["refused_wait"] == 1 and s.stats()["queue_depth"] == 16


def test_retry_after_is_the_time_the_work_ahead_needs_to_drain() -> None:
    s, _ = scheduler(max_wait_s=10.0)
    for _ in range(4):
        s.admit(job(1, 2560), None, None)  # 2.5 s each, counted in full by a request as large
    with pytest.raises(QueueFull) as refused:
        s.admit(job(1, 2560), None, None)  # waits 10 s, + 2.5 s of its own: 2.5 s over
    assert refused.value.retry_after_s == 3


def test_a_bulk_request_runs_beside_the_others_and_takes_only_its_share() -> None:
    s, _ = scheduler()
    s.admit(job(100, 128), None, "bulk")  # 12.5 s: over half the budget, so bulk; admitted on an idle engine
    assert s.stats()["backlog_seconds"] == 12.5 and s.stats()["queue_depth_bulk"] == 1
    assert s.stats()["predicted_wait_seconds"] == 0.0  # a one-item request does not wait for it
    for _ in range(8):  # beside bulk work, normal work runs at half speed: 8 of 0.125 s fit where 16 did alone
        s.admit(job(1, 128), None, None)
    assert s.stats()["predicted_wait_seconds"] == 8 * 0.125 * 2
    with pytest.raises(QueueFull):
        s.admit(job(1, 128), None, None)
    with pytest.raises(QueueFull) as refused:  # bulk requests run one at a time: this one would start in 25 s
        s.admit(job(100, 128), None, "second bulk")
    assert refused.value.retry_after_s == 23


def test_rounds_serve_normal_requests_in_order_and_slice_the_bulk_one_beside_them() -> None:
    s, clock = scheduler()
    bulk = s.admit(job(100, 128), None, "bulk")  # 100 rows of 0.125 s; a round is 0.5 s
    small = [s.admit(job(1, 64), None, f"small-{i}") for i in range(3)]
    late = big = after = None
    expected = [  # the bulk lane gets as much time as normal work got: 0.1875 s buys one row, and so on
        [("small-0", 0, 1), ("small-1", 0, 1), ("small-2", 0, 1), ("bulk", 0, 1)],
        [("late", 0, 1), ("bulk", 1, 2)],
        [("normal, longer than a round", 0, 2), ("bulk", 2, 4)],  # normal work's half of a round, then bulk's
        [("normal, longer than a round", 2, 4), ("bulk", 4, 6)],
        [("normal, longer than a round", 4, 6), ("bulk", 6, 8)],
        [("normal, longer than a round", 6, 7), ("after it", 0, 1), ("bulk", 8, 9)]]
    for i, pieces in enumerate(expected):
        round = s.next_round()
        assert [(p.entry.request_id, p.start, p.stop) for p in round.slices] == pieces
        if i == 0:
            assert round.predicted_s == 3 * 0.0625 + 0.125 and not any(f.done() for f in (bulk, *small))
            late = s.admit(job(1, 64), None, "late")
        clock.now += round.predicted_s  # rounds take what was predicted: the model stays put
        s.finish(round)
        if i == 1:  # 0.875 s at half speed beside the bulk request: 1.75 s, and 0.125 s more for the next one
            big = s.admit(job(7, 128), None, "normal, longer than a round")
            after = s.admit(job(1, 64), None, "after it")
    assert [p.entry.future for p in round.slices[:2]] == [big, after] and late is not None
    rounds, row = len(expected), 9
    while row < 100:  # alone, bulk fills whole rounds: 4 rows each, contiguous and in order
        round = s.next_round()
        (piece,) = round.slices
        assert piece.start == row
        row, rounds = piece.stop, rounds + 1
        clock.now += round.predicted_s
        s.finish(round)
    assert rounds == 6 + math.ceil(91 / 4) and s.stats()["queue_depth"] == 0


def test_a_shared_prefix_is_sliced_in_pieces_that_amortize_it() -> None:
    s, _ = scheduler(cost=shared_cost)
    s.admit(job(200), None, "shared")  # 2 s, bulk; its prefix costs as much as 5 rows: slices of at least 5
    (piece,) = s.next_round().slices
    assert piece.stop - piece.start >= 5 and piece.work.context == 50, "every slice computes its prefix once"
    assert piece.job.sequences == job(200).sequences[piece.start:piece.stop]


def test_a_bulk_slice_larger_than_its_share_comes_every_few_rounds() -> None:
    def wide_prefix(job: Job) -> Work:  # a 200-token prefix (0.2 s) before 10 tokens a row
        return Work(batches=1, context=200) + Work(continuation=10) * len(job.sequences)

    s, clock = scheduler(cost=wide_prefix)
    s.admit(job(400), None, "bulk")  # its smallest slice: 20 rows, 0.39 s, more than normal work's 0.2 s a round
    alone = s.next_round()  # with nothing else waiting, it gets a round of its own, however large its slice
    assert [p.entry.request_id for p in alone.slices] == ["bulk"] and alone.slices[0].stop >= 20
    clock.now += alone.predicted_s
    s.finish(alone)
    with_bulk = []
    for i in range(8):
        s.admit(job(1), None, f"normal-{i}")
        round = s.next_round()
        assert round.slices[0].entry.request_id == f"normal-{i}"  # normal work is in every round
        with_bulk += [i] if any(p.entry.request_id == "bulk" for p in round.slices) else []
        clock.now += round.predicted_s
        s.finish(round)
    assert with_bulk == [1, 3, 5, 7]  # two rounds' credit buys a slice: the lanes still split the device evenly


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
    round = s.next_round()
    assert [piece.entry.request_id for piece in round.slices] == ["kept"]
    assert isinstance(late.exception(0), DeadlineExceeded) and kept.running()
    s.admit(job(1, 512), None, None)  # 0.5 s queued
    with pytest.raises(QueueFull, match="past its deadline"):  # would start after its deadline: refused at once
        s.admit(job(1, 1), clock.now + 0.25, None)


def test_the_service_model_learns_the_device_from_rounds() -> None:
    true = ServiceModel(0.05, {"full": 1.5e-3, "context": 1e-3, "continuation": 2e-3, "completion": 2e-3})
    model = ServiceModel(0.2, dict.fromkeys(KINDS, 0.5e-3))  # a poor seed: 4x the batch price, a third of tokens
    shapes = [Work(batches=1, full=32), Work(batches=4, full=2048), Work(batches=2, context=512, continuation=256),
              Work(batches=1, completion=256), Work(batches=3, full=256, continuation=1024)]
    for _ in range(60):
        for work in shapes:
            model.observe(work, true.seconds(work))
    for work in shapes + [Work(batches=10, full=320), Work(batches=1, completion=2048, full=64)]:
        assert model.seconds(work) == pytest.approx(true.seconds(work), rel=0.15)
    before = model.seconds(shapes[0])
    model.observe(shapes[0], 100.0)  # one round slowed by something else moves the estimate a little
    assert model.seconds(shapes[0]) < 1.6 * before


class RowScorer:
    """A stub device: each row scores minus its first token (a mix-up of slices shows), a held gate stalls a round."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.rounds: list[list[tuple[int, int]]] = []  # per round: (first token of the first row, rows) per job

    @staticmethod
    def cost(jobs, marginal: bool = False) -> Work:
        return Work(full=sum(len(seq) for job in jobs for seq in job.sequences))

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
        bulk = engine.submit([[1000 + row] * 128 for row in range(40)], [0])  # 5 s: bulk, sliced
        small = [engine.submit([[i] * 64], [0]) for i in range(3)]
        bulk.add_done_callback(lambda _: done.append("bulk"))
        for i, future in enumerate(small):
            future.add_done_callback(lambda _, i=i: done.append(f"small-{i}"))
        scorer.gate.set()
        assert bulk.result(30).logprobs[:, 0].tolist() == [-1000.0 - row for row in range(40)]
        assert [f.result(30).logprobs.tolist() for f in small] == [[[0.0]], [[-1.0]], [[-2.0]]]
        assert blocker.result(30).logprobs.tolist() == [[-7.0]]
    finally:
        scorer.gate.set()
        engine.stop(5)
    assert done[-1] == "bulk" and sorted(done[:3]) == ["small-0", "small-1", "small-2"]
    bulk_rounds = [r for r in scorer.rounds if any(first >= 1000 for first, _ in r)]
    assert len(bulk_rounds) >= 3 and [first for first, _ in scorer.rounds[1][:3]] == [0, 1, 2]


def test_the_queue_is_predicted_as_badly_packed_as_the_last_rounds() -> None:
    clock = Clock()
    doubled = Scheduler(ServiceModel(0.0, SECONDS_PER_TOKEN), full_cost, 256, 2.0, clock=clock,
                        round_cost=lambda jobs: full_cost(Job([s for job in jobs for s in job.sequences])) * 2)
    doubled.admit(job(1, 128), None, "first")  # 0.125 s as estimated; its round is planned at 0.25 s
    round = doubled.next_round()
    assert round.predicted_s == 0.25 and doubled.packing == 2.0
    for _ in range(3):
        doubled.admit(job(1, 128), None, None)
    # the round in flight (0.25 s) and three requests at twice their estimate
    assert doubled.stats()["predicted_wait_seconds"] == 0.25 + 3 * 0.25
