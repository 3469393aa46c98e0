"""On an accelerator the device thread keeps the device busy: the next round is planned and dispatched before the
previous round's results are fetched, and a lone round is finished at once. A stub scorer records the order."""

from __future__ import annotations

import threading

import numpy as np

from runtime.assembly.compose import bucket_plan
from runtime.engine import Engine
from runtime.assembly.platform import resolve
from runtime.settings import load_settings
from tests.runtime.engine.stubs import TokenCountCost

WAIT_S = 30.0


class RecordingScorer(TokenCountCost):
    """dispatch() returns at once (as JAX does); collect() blocks until the test lets the 'device' finish."""

    def __init__(self) -> None:
        settings = load_settings(environ={})
        self.plan = bucket_plan(settings, resolve(settings, backend="cpu"))
        self.events: list[str] = []
        self.device_done = threading.Event()
        self.dispatched = threading.Event()
        self.rounds = 0

    def dispatch(self, jobs):
        self.rounds += 1
        self.events.append(f"dispatch {self.rounds}")
        self.dispatched.set()
        return self.rounds, [np.full((len(job.sequences), len(job.label_ids)), -float(self.rounds), np.float32)
                             for job in jobs]

    def collect(self, dispatched):
        number, results = dispatched
        assert self.device_done.wait(WAIT_S)
        self.events.append(f"collect {number}")
        return results


def test_the_next_round_is_dispatched_before_the_previous_one_is_fetched():
    engine = Engine(load_settings(environ={}, batch_wait_ms=0.0))
    engine.vocab_size = 100
    engine.rounds_in_flight = resolve(engine.settings, backend="gpu").rounds_in_flight  # an accelerator's: 2
    scorer = RecordingScorer()
    engine.start_with(scorer)
    try:
        first = engine.submit([[1, 2]], [3])
        assert scorer.dispatched.wait(WAIT_S)
        scorer.dispatched.clear()
        second = engine.submit([[4, 5, 6]], [7, 8])  # arrives while round 1 is on the "device"
        assert scorer.dispatched.wait(WAIT_S)
        scorer.device_done.set()
        assert first.result(WAIT_S).logprobs.tolist() == [[-1.0]]
        assert second.result(WAIT_S).logprobs.tolist() == [[-2.0, -2.0]]
        assert scorer.events == ["dispatch 1", "dispatch 2", "collect 1", "collect 2"]
    finally:
        scorer.device_done.set()
        engine.stop(5)


def test_a_lone_round_is_finished_without_waiting_for_another():
    engine = Engine(load_settings(environ={}, batch_wait_ms=0.0))
    engine.vocab_size = 100
    scorer = RecordingScorer()
    scorer.device_done.set()
    engine.start_with(scorer)
    try:
        assert engine.submit([[1]], [2]).result(WAIT_S).logprobs.tolist() == [[-1.0]]
        assert scorer.events == ["dispatch 1", "collect 1"]
    finally:
        engine.stop(5)


def test_the_stand_in_scorers_implement_what_the_engine_needs():
    from runtime.requests.rounds import RoundScorer
    from runtime.requests.scorer import Scorer
    from tests.handler.test_tracing import GatedScorer
    from tests.runtime.engine.test_faults import StubScorer

    assert issubclass(Scorer, RoundScorer)
    for stand_in in (RecordingScorer, StubScorer, GatedScorer):
        missing = [name for name in ("cost", "slice_rows", "dispatch", "collect", "counters")
                   if not callable(getattr(stand_in, name, None))]
        assert not missing, f"{stand_in.__name__} lacks {missing}"
