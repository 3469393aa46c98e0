"""Admission and device rounds: answer small requests fast, refuse only what cannot be answered in time, and under
overload refuse every kind of request alike.

Requests are weighed in predicted device seconds of their padded tokens (runtime.requests.cost), never by count. A
request's *own* work is its estimate alone; *small* requests (own work within half of SCOREFN_MAX_WAIT_S) are those
whose latency the budget bounds. The request threads admit them (runtime.requests.admission: which are queued, which
refused, and why), the device thread takes them in rounds (runtime.requests.round_builder: what each round
computes), and both read and change the work admitted and not done (runtime.requests.backlog) under its lock. Pure
Python: the scorer is reached through `cost`, `round_cost` and the jobs it is given.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

from runtime.requests.admission import AdmissionControl
from runtime.requests.backlog import Backlog
from runtime.requests.cost import ServiceModel, Work
from runtime.requests.round_builder import RoundBuilder, admission_limits, round_budget
from runtime.requests.slices import Entry, Round


class Scheduler:
    """What the engine calls: admission on the request threads, rounds on the device thread, and the life cycle."""

    def __init__(self, model: ServiceModel, cost: Callable[[Any], Work], max_queue: int, max_wait_s: float | None,
                 max_round_s: float | None, round_cost: Callable[[list], Work] | None = None,
                 clock: Callable[[], float] = time.monotonic, slice_rows: Callable[[Any], int] | None = None,
                 admitted: Callable[[Any, float], None] | None = None) -> None:
        """`cost(job)`: a request's device work on a busy device (what it adds to a round); `round_cost(jobs)`: the
        work of a round as the scorer plans it (default: the sum of its slices'); `slice_rows(job)`: the fewest of
        its rows worth a slice (default 1); `admitted(job, until)`: told of each request queued (AdmissionControl).
        `max_wait_s`, `max_round_s`: None for auto, from the model's price of a device batch (admission_limits)."""
        self.backlog = Backlog(model, clock)
        max_wait_s, max_round_s = admission_limits(max_wait_s, max_round_s, model.per_batch)
        self.round_s = round_budget(max_wait_s, max_round_s)
        alone = None if round_cost is None else (lambda job: round_cost([job]))
        self.admission = AdmissionControl(self.backlog, cost, max_queue, max_wait_s, self.round_s, slice_rows, alone,
                                          admitted)
        self.rounds = RoundBuilder(self.backlog, self.round_s, round_cost, self.admission.refuse_late)

    @property
    def refused(self) -> dict[str, int]:
        """Requests refused so far, by reason."""
        return self.admission.refused

    def admit(self, job: Any, deadline: float | None, request_id: str | None,
              trace: Any = None) -> concurrent.futures.Future:
        return self.admission.admit(job, deadline, request_id, trace)

    def next_round(self, coalesce_s: float = 0.0) -> Round | None:
        return self.rounds.next_round(coalesce_s)

    def finish(self, round: Round) -> float:
        return self.rounds.finish(round)

    def drop(self, entry: Entry) -> None:
        self.rounds.drop(entry)

    # ---- life cycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        self.admission.close()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False if `timeout` passed first."""
        backlog = self.backlog
        with backlog.lock:
            return backlog.lock.wait_for(lambda: not (backlog.queue or backlog.in_flight), timeout)

    def take_waiting(self) -> list[Entry]:
        """Remove and return every request still queued (the drain's grace period is over)."""
        with self.backlog.lock:
            waiting, self.backlog.queue = self.backlog.queue, []
            return waiting

    def stop(self) -> None:
        self.rounds.stop()

    def stats(self) -> dict[str, float]:
        admission, backlog = self.admission, self.backlog
        with backlog.lock:
            return {"queue_depth": len(backlog.queue),
                    "predicted_wait_seconds": admission.wait_s(0.0),
                    "backlog_seconds": backlog.seconds(), "packing": backlog.packing,
                    "load": admission.load(), "max_wait_seconds": admission.max_wait_s,
                    "round_budget_seconds": self.round_s,
                    "admitted": admission.admitted, **{f"refused_{reason}": n for reason, n in self.refused.items()}}
