"""Admission by predicted wait, and device rounds that interleave large requests with small ones.

Rounds. Admitted requests wait in a ring. Each device round takes up to `round_s` (a quarter of SCOREFN_MAX_WAIT_S)
of predicted device work, handing each request, in ring order, at most `quantum_s` (half a round) per pass; a
request larger than that is cut into slices of its items and is served again in later rounds. After a round, the
requests it served go behind those it did not reach (round robin). So a one-item request admitted behind a
1,024-item one waits for a slice of it, never for all of it, and the large one still moves on every round.

Admission follows from that schedule. A request whose own work is predicted to take `own` seconds waits for the
rounds in flight and, for each request already in the ring, for what that one has left or `own` rounded up to a
quantum, whichever is less (processor sharing, in slices): its predicted wait. It is admitted when

    wait + min(own, max_wait / 2) <= max_wait    and it would start before its deadline,

so a request too large to meet the budget on its own (own > max_wait / 2) needs half of the budget free. Otherwise
QueueFull, with the seconds the work ahead needs to drain that far as its Retry-After. Work is weighed in predicted
device seconds of its padded tokens (runtime.serving.cost), never by counting requests; SCOREFN_MAX_QUEUE stays a
hard cap on their number. Pure Python: the scorer is reached through `cost` and the jobs it is given.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Any, Callable

from runtime.interface import DeadlineExceeded, QueueFull
from runtime.serving.cost import ServiceModel, Work


@dataclasses.dataclass(eq=False)
class Entry:
    """An admitted request: its job, what a slice of it costs, and how far it has got."""
    job: Any  # runtime.serving.scorer's Job or TokenJob
    deadline: float | None  # time.monotonic() after which it is dropped if not started
    request_id: str | None
    shared: Work  # paid by every slice: a shared prefix's context (empty when the rows stand alone)
    per_row: Work  # each row's share of the rest
    submitted: float = 0.0
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    next_row: int = 0  # rows [0, next_row) are dispatched
    started: bool = False  # its first slice is taken (its future is running)
    parts: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # (first row, a slice's result)
    rows_done: int = 0
    device_s: float = 0.0  # seconds of the rounds that carried its slices

    @property
    def rows(self) -> int:
        return len(self.job.sequences)

    @property
    def rows_left(self) -> int:
        return self.rows - self.next_row

    def left(self) -> Work:
        return self.shared + self.per_row * self.rows_left if self.rows_left else Work()

    def add(self, start: int, result: Any, seconds: float) -> bool:
        """A slice's result; True once every row has one."""
        self.parts.append((start, result))
        self.rows_done += len(result)
        self.device_s += seconds
        return self.rows_done == self.rows

    def results(self) -> list:
        return [result for _, result in sorted(self.parts, key=lambda part: part[0])]


@dataclasses.dataclass(eq=False)
class Slice:
    """Rows [start, stop) of an entry, computed in one round."""
    entry: Entry
    start: int
    stop: int

    @property
    def work(self) -> Work:
        return self.entry.shared + self.entry.per_row * (self.stop - self.start)

    @property
    def job(self) -> Any:
        job = self.entry.job
        if self.start == 0 and self.stop == self.entry.rows:
            return job
        changes = {"sequences": job.sequences[self.start:self.stop]}
        if hasattr(job, "sampling"):  # a TokenJob: one Sampling per sequence
            changes["sampling"] = job.sampling[self.start:self.stop]
        return dataclasses.replace(job, **changes)


@dataclasses.dataclass(eq=False)
class Round:
    slices: list[Slice]
    work: Work
    predicted_s: float
    started: float  # when its device work began: dispatch, or the end of the round before it when pipelined
    dispatched: Any = None  # the scorer's handle
    error: Exception | None = None


class Scheduler:
    def __init__(self, model: ServiceModel, cost: Callable[[Any], Work], max_queue: int, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.round_s = max_wait_s / 4
        self.quantum_s = self.round_s / 2
        self.refused = {"wait": 0, "queue": 0}
        self._cost = cost
        self._clock = clock
        self._ring: list[Entry] = []
        self._in_flight: list[Round] = []
        self._cv = threading.Condition()
        self._closed = False  # no new work
        self._stopped = False  # next_round() answers None

    # ---- admission (request threads) ------------------------------------------------------------------

    def admit(self, job: Any, deadline: float | None, request_id: str | None) -> concurrent.futures.Future:
        work = self._cost(job)  # outside the lock: finding a shared prefix reads every sequence
        shared = Work(batches=1, context=work.context) if work.context else Work()
        entry = Entry(job, deadline, request_id, shared, (work - shared) * (1 / len(job.sequences)))
        own = self.model.seconds(work)
        with self._cv:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._ring) >= self.max_queue:
                self.refused["queue"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting (SCOREFN_MAX_QUEUE)",
                                retry_after_s=math.ceil(self._in_flight_s() + self.round_s))
            now = self._clock()
            wait = self._wait_s(own)
            over = wait + min(own, self.max_wait_s / 2) - self.max_wait_s
            late = now + wait - deadline if deadline is not None else 0.0
            if over > 0 or late > 0:
                self.refused["wait"] += 1
                raise QueueFull(f"this request would wait {wait:.1f} s for the device (its own work: {own:.1f} s), "
                                f"over the limit of {self.max_wait_s:g} s (SCOREFN_MAX_WAIT_S)",
                                retry_after_s=math.ceil(max(over, late)))
            entry.submitted = now
            self._ring.append(entry)
            self._cv.notify_all()
        return entry.future

    def _wait_s(self, own: float) -> float:
        """Predicted seconds before a new request of `own` seconds is done, less its own work (lock held)."""
        horizon = max(1, math.ceil(own / self.quantum_s)) * self.quantum_s
        return self._in_flight_s() + sum(min(self.model.seconds(e.left()), horizon) for e in self._ring)

    def _in_flight_s(self) -> float:
        if not self._in_flight:
            return 0.0
        predicted = [r.predicted_s for r in self._in_flight]
        elapsed = self._clock() - self._in_flight[0].started
        return max(sum(predicted) - elapsed, sum(predicted[1:]))

    # ---- rounds (the device thread) -------------------------------------------------------------------

    def next_round(self, coalesce_s: float = 0.0) -> Round | None:
        """The next round to dispatch, waiting for work; on an idle device, first up to `coalesce_s` for more
        requests to join it. None once stopped."""
        with self._cv:
            while True:
                while not self._ring and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return None
                if coalesce_s > 0 and not self._in_flight:
                    until = self._clock() + coalesce_s
                    while (not self._stopped and sum(self.model.seconds(e.left()) for e in self._ring) < self.round_s
                           and (remaining := until - self._clock()) > 0):
                        self._cv.wait(remaining)
                slices = self._take()
                if slices:
                    work = sum((s.work for s in slices), Work())
                    round = Round(slices, work, self.model.seconds(work), self._clock())
                    self._in_flight.append(round)
                    return round

    def _take(self) -> list[Slice]:
        """Fill a round: passes over the ring, each request getting at most a quantum per pass (lock held)."""
        budget = self.round_s
        taken: dict[Entry, Slice] = {}
        progress = True
        while budget > 0 and progress:
            progress = False
            for entry in list(self._ring):
                if budget <= 0:
                    break
                if not entry.started and not self._start(entry):
                    self._ring.remove(entry)
                    continue
                current = taken.get(entry)
                rows = self._slice_rows(entry, min(self.quantum_s, budget), first=current is None,
                                        force=not taken)
                if not rows:
                    continue
                added = Slice(entry, entry.next_row, entry.next_row + rows)
                budget -= self.model.seconds(added.work if current is None else entry.per_row * rows)
                entry.next_row += rows
                if current is None:
                    taken[entry] = added
                else:
                    current.stop = entry.next_row  # slices of one request in one round are contiguous
                progress = True
                if not entry.rows_left:
                    self._ring.remove(entry)
        # Round robin: those served go behind those not reached.
        self._ring = [e for e in self._ring if e not in taken] + [e for e in self._ring if e in taken]
        return list(taken.values())

    def _slice_rows(self, entry: Entry, limit_s: float, first: bool, force: bool) -> int:
        """How many of the entry's next rows fit in `limit_s` (0: not even its smallest slice, unless forced)."""
        row_s = self.model.seconds(entry.per_row)
        shared_s = self.model.seconds(entry.shared)
        # A shared prefix is computed again for every slice: slices hold at least 3x its cost (and 2 rows).
        smallest = min(max(2, math.ceil(3 * shared_s / row_s - 1e-9)), entry.rows_left) if entry.shared.batches else 1
        fits = int((limit_s - (shared_s if first else 0.0)) // row_s)
        least = smallest if first else 1
        if fits < least and not force:
            return 0
        rows = max(fits, least)
        if entry.rows_left - rows < smallest:  # no tail too small to share its prefix
            rows = entry.rows_left
        return min(rows, entry.rows_left)

    def _start(self, entry: Entry) -> bool:
        """Mark a request's future running before its first slice; False if the client went away or it waited
        past its deadline (its future then says so)."""
        if not entry.future.set_running_or_notify_cancel():
            return False
        now = self._clock()
        if entry.deadline is not None and now > entry.deadline:
            entry.future.set_exception(DeadlineExceeded(
                f"waited {now - entry.submitted:.2f} s in the queue, past the request deadline"))
            return False
        entry.started = True
        return True

    def finish(self, round: Round) -> float:
        """A round's results are fetched (or it failed): learn from its time, free its place. Returns its seconds."""
        now = self._clock()
        seconds = now - round.started
        if round.error is None:
            self.model.observe(round.work, seconds)
        with self._cv:
            self._in_flight.remove(round)
            if self._in_flight:  # pipelined: the next round's device work starts now at the latest
                self._in_flight[0].started = max(self._in_flight[0].started, now)
            self._cv.notify_all()
        return seconds

    def drop(self, entry: Entry) -> None:
        """A failed request: none of its other rows are computed."""
        with self._cv:
            if entry in self._ring:
                self._ring.remove(entry)

    # ---- life cycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._cv:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False if `timeout` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._ring and not self._in_flight, timeout)

    def take_waiting(self) -> list[Entry]:
        """Remove and return every request still waiting (the drain's grace period is over)."""
        with self._cv:
            waiting, self._ring = self._ring, []
            return waiting

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def stats(self) -> dict[str, float]:
        with self._cv:
            return {"queue_depth": len(self._ring),
                    "predicted_wait_seconds": self._wait_s(0.0),
                    "backlog_seconds": self._in_flight_s() + sum(self.model.seconds(e.left()) for e in self._ring),
                    "max_wait_seconds": self.max_wait_s,
                    "refused_wait": self.refused["wait"], "refused_queue": self.refused["queue"]}
