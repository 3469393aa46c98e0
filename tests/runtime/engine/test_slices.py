"""The engine answers small requests between the slices of a large one: the real engine, scheduler and device thread
around a stub scorer whose rows score minus their first token (a mix-up of slices shows)."""

from __future__ import annotations

import threading

import numpy as np

from runtime.engine import Engine
from runtime.requests.cost import ServiceModel, Work
from runtime.settings import load_settings
from tests.runtime.requests.stepped import SECONDS_PER_TOKEN


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


class FixedPrices(ServiceModel):
    """The stub device's prices, kept: its rounds take no time at all, which a model that learns would price."""

    def observe(self, work: Work, seconds: float) -> None:
        pass


def test_the_engine_answers_small_requests_between_the_slices_of_a_large_one() -> None:
    engine = Engine(load_settings(environ={}, batch_wait_ms=0.0))
    scorer = RowScorer()
    engine.start_with(scorer, FixedPrices(0.0, SECONDS_PER_TOKEN))
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
