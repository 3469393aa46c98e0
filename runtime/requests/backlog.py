"""The work admitted and not done, which admission (runtime.requests.admission) and the device rounds
(runtime.requests.round_builder) share under one lock: the queued requests, the rounds in flight, and the predicted
device seconds they hold. Pure Python."""

from __future__ import annotations

import threading
from typing import Callable

from runtime.requests.cost import ServiceModel
from runtime.requests.slices import Entry, Round


class Backlog:
    def __init__(self, model: ServiceModel, clock: Callable[[], float]) -> None:
        self.model = model
        self.clock = clock
        self.queue: list[Entry] = []  # admitted, not finished, in order of arrival
        self.in_flight: list[Round] = []
        self.packing = 1.0  # rounds' planned cost over their slices' priced work (a moving average)
        self.lock = threading.Condition()  # guards all of the above; notified when it changes

    def seconds(self) -> float:
        """The work admitted and not done (lock held)."""
        return self.in_flight_s() + self.queued_s()

    def queued_s(self) -> float:
        return sum(self.left_s(e) for e in self.queue)

    def left_s(self, entry: Entry) -> float:
        """An entry's predicted seconds left, kept until its rows or the model's prices change: admission reads every
        queued entry for every request (two thirds of a simulated overload's time, before)."""
        key = (entry.next_row, self.model.rounds)
        if entry.left_cache is None or entry.left_cache[0] != key:
            entry.left_cache = (key, self.model.seconds(entry.left()))
        return entry.left_cache[1]

    def in_flight_s(self) -> float:
        """Predicted seconds until the rounds dispatched are done: what is left of the oldest one (nothing, once it
        overruns), then the others at the current slowdown."""
        if not self.in_flight:
            return 0.0
        oldest, *others = self.in_flight
        left = max(0.0, oldest.predicted_s - (self.clock() - oldest.started))
        return left + self._slowdown() * sum(r.predicted_s for r in others)

    def _slowdown(self) -> float:
        if not self.in_flight:
            return 1.0
        oldest = self.in_flight[0]
        return max(1.0, (self.clock() - oldest.started) / max(oldest.predicted_s, 1e-6))
