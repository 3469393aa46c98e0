"""Device rounds: what the device computes next, taken from the queued requests (runtime.requests.backlog).

A device round holds up to `round_s` (a quarter of SCOREFN_MAX_WAIT_S, at most SCOREFN_MAX_ROUND_S) of predicted
work: its requests are answered when all of it is done and a new small request waits for the round in flight, so
longer rounds would only delay answers (shorter ones pay their device batches' price more often). Work is taken
shortest predicted remaining work first (ties: first come, first served), so a one-item request waits for the round
in flight and for other small work, never for all of a 1,024-item one; large requests run in slices of their rows,
each large enough that its device batch and its shared prefix cost little next to its rows (a slice larger than what
is left of the budget is still taken while half of it is left). The request that has waited longest gets
OLDEST_SHARE of the device time of every round it is not in (a credit spent on its next slice), so the largest
request moves on however much smaller work keeps arriving; one that has waited half of its deadline without starting
starts in the next round. A round taken with work left queued behind it updates the backlog's `packing` (its cost as
the scorer plans it over its slices' price: what queued work costs); a round done teaches the service model its time.
Pure Python.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from runtime.interface import DeadlineExceeded
from runtime.requests.backlog import Backlog
from runtime.requests.cost import Work
from runtime.requests.slices import Entry, Round, Slice


ROUND_BATCHES = 5  # an automatic round holds the fixed price of this many device batches ...
ROUND_S = (0.3, 1.0)  # ... within these seconds
MIN_WAIT_S = 2.0  # the least automatic SCOREFN_MAX_WAIT_S


def round_budget(max_wait_s: float, max_round_s: float) -> float:
    """The predicted seconds of work a device round holds: a quarter of SCOREFN_MAX_WAIT_S, at most
    SCOREFN_MAX_ROUND_S."""
    return min(max_wait_s / 4, max_round_s)


def admission_limits(max_wait_s: float | None, max_round_s: float | None, per_batch_s: float) -> tuple[float, float]:
    """(SCOREFN_MAX_WAIT_S, SCOREFN_MAX_ROUND_S), each as set or, when auto (None), from this device's price of a
    device batch (`per_batch_s`, the start's calibration): a round holds ROUND_BATCHES batches' fixed price (within
    ROUND_S: fewer and a busy round pays its batches' price on few rows), the wait four rounds, at least MIN_WAIT_S.
    A fast device keeps 0.3 s and 2 s; a slow CPU, whose batch alone costs ~0.15-0.25 s (a 2-core AVX2 EPYC),
    gets rounds that hold a burst's rows and a wait that covers them (docs/how-it-works/admission.md)."""
    if max_round_s is None:
        max_round_s = min(max(ROUND_BATCHES * per_batch_s, ROUND_S[0]), ROUND_S[1])
    if max_wait_s is None:
        max_wait_s = max(MIN_WAIT_S, 4 * max_round_s)
    return max_wait_s, max_round_s


class RoundBuilder:
    """Fills the device thread's rounds from the backlog's queue and frees their places once they are done."""

    OLDEST_SHARE = 0.1  # of the device time of a round, for the request waiting longest
    SLICE_OVERHEAD = 0.5  # a slice's device batch may add at most this to the price of each of its rows
    PACKING_RATE = 0.2  # how far one round moves `packing` towards what it measured

    def __init__(self, backlog: Backlog, round_s: float, round_cost: Callable[[list], Work] | None,
                 refuse_late: Callable[[float], None]) -> None:
        """`round_cost(jobs)`: the work of a round as the scorer plans it (None: the sum of its slices');
        `refuse_late(next_start)`: admission's, told (lock held) when the round after the one just taken can start
        at the earliest."""
        self.backlog = backlog
        self.model = backlog.model
        self.round_s = round_s
        self._round_cost = round_cost
        self._refuse_late = refuse_late
        self._clock = backlog.clock
        self._credit = 0.0  # device seconds the oldest request has earned and not yet spent
        self._rounds = 0  # taken so far
        self._stopped = False  # next_round() answers None

    def next_round(self, coalesce_s: float = 0.0) -> Round | None:
        """The next round to dispatch, waiting for work; on an idle device, first up to `coalesce_s` for more
        requests to join it. None once stopped."""
        backlog = self.backlog
        with backlog.lock:
            while True:
                while not backlog.queue and not self._stopped:
                    backlog.lock.wait()
                if self._stopped:
                    return None
                if coalesce_s > 0 and not backlog.in_flight:
                    until = self._clock() + coalesce_s
                    while (not self._stopped and backlog.queued_s() < self.round_s
                           and (remaining := until - self._clock()) > 0):
                        backlog.lock.wait(remaining)
                slices = self._take()
                if slices:
                    work = sum((s.work for s in slices), Work())
                    if self._round_cost is not None:  # as planned: rows padded together, batches shared
                        priced = self.model.seconds(work)
                        work = self._round_cost([s.job for s in slices])
                        if priced > 0 and backlog.queue:  # busy: what work queued behind a round costs
                            packing = max(1.0, self.model.seconds(work) / priced)
                            backlog.packing += self.PACKING_RATE * (packing - backlog.packing)
                    self._rounds += 1
                    round = Round(slices, work, self.model.seconds(work), self._clock(), self._rounds)
                    backlog.in_flight.append(round)
                    self._refuse_late(round.started + backlog.in_flight[0].predicted_s)
                    return round
                # Nothing taken: every queued request was dropped (cancelled, or past its deadline).

    def _take(self) -> list[Slice]:
        """Fill a round (lock held): shortest remaining work first, slices of the rest up to the round's budget,
        and the oldest request's slice once its credit pays for one."""
        self._drop_dead()
        queue = self.backlog.queue
        if not queue:
            return []
        now = self._clock()
        late = [e for e in queue if not e.started and e.deadline is not None
                and now > (e.submitted + e.deadline) / 2]  # half its time to the deadline gone: it starts now
        order = late + sorted((e for e in queue if e not in late),
                              key=lambda e: (self.backlog.left_s(e), e.submitted))
        oldest = queue[0]
        budget, taken, others_s = self.round_s, [], 0.0
        for entry in order:
            # A slice that does not fit is still taken while half of the budget is left: short rounds stay full.
            rows = self._slice_rows(entry, budget, force=budget >= self.round_s / 2)
            if not rows:
                break  # shortest first: nothing longer overtakes it
            if not self._start(entry):
                continue
            spent = self._add(taken, entry, rows)
            budget -= spent
            if entry is not oldest:
                others_s += spent
            if budget <= 0:
                break
        if oldest.rows_left and not any(piece.entry is oldest for piece in taken):
            self._credit += others_s * self.OLDEST_SHARE / (1 - self.OLDEST_SHARE)
            if (self._credit >= self._smallest_s(oldest) or not taken) and self._start(oldest):
                spent = self._add(taken, oldest, self._slice_rows(oldest, max(self._credit, budget), force=True))
                self._credit = max(0.0, self._credit - spent)
        else:
            self._credit = 0.0
        self.backlog.queue = [e for e in queue if e.rows_left and not e.future.cancelled()]
        return taken

    def _add(self, taken: list[Slice], entry: Entry, rows: int) -> float:
        """Put the entry's next `rows` in the round; returns their predicted seconds."""
        piece = Slice(entry, entry.next_row, entry.next_row + rows)
        taken.append(piece)
        entry.next_row += rows
        return self.model.seconds(piece.work)

    def _drop_dead(self) -> None:
        """Drop the queued requests that have not started and whose client went away or whose deadline passed (their
        futures then say so; lock held)."""
        now = self._clock()
        kept = []
        for entry in self.backlog.queue:
            if not entry.started and entry.future.cancelled():
                continue
            if not entry.started and entry.deadline is not None and now > entry.deadline:
                entry.future.set_exception(DeadlineExceeded(
                    f"waited {now - entry.submitted:.2f} s in the queue, past the request deadline"))
                if entry.trace is not None:
                    entry.trace.left_queue(None, time.time_ns())
                continue
            kept.append(entry)
        self.backlog.queue = kept

    def _smallest(self, entry: Entry) -> int:
        """Rows of an entry's smallest slice: enough that its device batch adds at most SLICE_OVERHEAD to each row's
        price, and with a shared prefix (computed again for every slice) enough rows to cost as much as the prefix,
        and to fill its first device batch after it (entry.min_rows): slicing costs little of the device time it
        splits."""
        row_s = self.model.seconds(entry.per_row)
        rows = math.ceil(self.model.seconds(Work(batches=1)) / (self.SLICE_OVERHEAD * row_s) - 1e-9)
        if entry.shared.batches:
            rows = max(rows, 2, entry.min_rows, math.ceil(self.model.seconds(entry.shared) / row_s - 1e-9))
        return min(max(1, rows), entry.rows_left)

    def _smallest_s(self, entry: Entry) -> float:
        return self.model.seconds(entry.shared + entry.per_row * self._smallest(entry))

    def _slice_rows(self, entry: Entry, limit_s: float, force: bool) -> int:
        """How many of the entry's next rows fit in `limit_s` (0: not even its smallest slice, unless forced)."""
        smallest = self._smallest(entry)
        fits = int((limit_s - self.model.seconds(entry.shared)) // self.model.seconds(entry.per_row))
        if fits < smallest and not force:
            return 0
        rows = max(fits, smallest)
        if entry.rows_left - rows < smallest:  # no tail too small to share its prefix and batch
            rows = entry.rows_left
        return min(rows, entry.rows_left)

    def _start(self, entry: Entry) -> bool:
        """Mark a request's future running before its first slice; False if its client has just gone away."""
        if not entry.started:
            entry.started = entry.future.set_running_or_notify_cancel()
        return entry.started

    def finish(self, round: Round) -> float:
        """A round's results are fetched (or it failed): learn from its time, free its place. Returns its seconds."""
        now = self._clock()
        seconds = now - round.started
        with self.backlog.lock:
            in_flight = self.backlog.in_flight
            if round.error is None:
                self.model.observe(round.work, seconds)
            in_flight.remove(round)
            if in_flight:  # pipelined: the next round's device work starts now at the latest
                in_flight[0].started = max(in_flight[0].started, now)
            self.backlog.lock.notify_all()
        return seconds

    def drop(self, entry: Entry) -> None:
        """A failed request: none of its other rows are computed."""
        with self.backlog.lock:
            if entry in self.backlog.queue:
                self.backlog.queue.remove(entry)

    def stop(self) -> None:
        with self.backlog.lock:
            self._stopped = True
            self.backlog.lock.notify_all()
