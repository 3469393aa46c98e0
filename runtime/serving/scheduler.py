"""Admission by predicted wait, and device rounds that keep large requests from holding up small ones.

Two lanes. A request whose own work is predicted to take at most half of SCOREFN_MAX_WAIT_S is *normal*; a larger one
(it could not meet the budget at half the device) is *bulk*. Normal requests are served first come, first served;
bulk requests one at a time, beside them. A device round holds up to `round_s` (a quarter of the budget, at most
ROUND_S) of predicted work: normal requests in order (one that does not fit goes on first in the next round); while
normal work waits it gets (1 - BULK_SHARE) of the round, and the head bulk request as much device time as normal work
got (BULK_SHARE 0.5: the same), in slices of its items (deficit round robin: a slice larger than that comes every few
rounds); with no normal work waiting, the bulk request gets whole rounds. So a one-item request never waits for all of a
1,024-item request, only for slices of it, and the large one moves on all the time.

Admission follows from that schedule (`own`: the request's predicted device seconds, `ahead`: what the requests
before it in its lane still have to run, `inflight`: the rounds dispatched and not done):

    normal: inflight + (ahead + own) * stretch <= max_wait,   stretch = 1 / (1 - BULK_SHARE) while bulk work waits
    bulk:   inflight + ahead / BULK_SHARE <= max_wait          (it starts within the budget)

and it must start before its deadline. Otherwise QueueFull, with the seconds the work ahead needs to drain that far
as Retry-After. Requests are weighed in predicted device seconds of their padded tokens (runtime.serving.cost), never
by count; SCOREFN_MAX_QUEUE stays a hard cap on their number. Pure Python: the scorer is reached through `cost`,
`round_cost` and the jobs it is given.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import threading
import time
from typing import Any, Callable

from runtime.interface import DeadlineExceeded, QueueFull, ShuttingDown
from runtime.serving.cost import ServiceModel, Work
from runtime.serving.slices import Entry, Round, Slice


class Scheduler:
    BULK_SHARE = 0.5  # of the device, for the head bulk request while normal work waits
    PACKING_ROUNDS = 8  # rounds whose packing and overrun the queue's prediction heeds
    # Rounds longer than this would only delay answers: a round's requests are answered when all of it is done, and
    # its device batches are bounded by the largest bucket anyway.
    ROUND_S = 0.5

    def __init__(self, model: ServiceModel, cost: Callable[[Any], Work], max_queue: int, max_wait_s: float,
                 round_cost: Callable[[list], Work] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`cost(job)`: a request's device work on a busy device (what it adds to a round); `round_cost(jobs)`: the
        work of a round as the scorer plans it (default: the sum of its slices')."""
        self.model = model
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.round_s = min(max_wait_s / 4, self.ROUND_S)
        self.refused = {"wait": 0, "queue": 0}
        self.admitted = 0
        self._packings: collections.deque[float] = collections.deque([1.0], maxlen=self.PACKING_ROUNDS)
        self._overruns: collections.deque[float] = collections.deque([1.0], maxlen=self.PACKING_ROUNDS)
        self._bulk_credit = 0.0  # seconds of device time the bulk lane has earned and not yet spent
        self._cost = cost
        self._round_cost = round_cost
        self._clock = clock
        self._normal: list[Entry] = []  # first come, first served
        self._bulk: list[Entry] = []  # one at a time, beside the normal ones
        self._in_flight: list[Round] = []
        self._cv = threading.Condition()
        self._closed = False  # no new work
        self._stopped = False  # next_round() answers None

    # ---- admission (request threads) ------------------------------------------------------------------

    def admit(self, job: Any, deadline: float | None, request_id: str | None) -> concurrent.futures.Future:
        work = self._cost(job)  # outside the lock: finding a shared prefix reads every sequence
        shared = Work(batches=1, context=work.context) if work.context else Work()
        entry = Entry(job, deadline, request_id, shared, (work - shared) * (1 / len(job.sequences)))
        with self._cv:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._normal) + len(self._bulk) >= self.max_queue:
                self.refused["queue"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting (SCOREFN_MAX_QUEUE)",
                                retry_after_s=math.ceil(self._in_flight_s() + self.round_s))
            own = self._seconds(work)
            entry.bulk = own > self.max_wait_s / 2
            now = self._clock()
            if entry.bulk:
                wait = self._bulk_wait_s()
                over = wait - self.max_wait_s
            else:
                wait = self._normal_wait_s()
                over = wait + own * self._stretch() - self.max_wait_s
            late = now + wait - deadline if deadline is not None else 0.0
            if over > 0 or late > 0:
                self.refused["wait"] += 1
                limit = (f"over the limit of {self.max_wait_s:g} s (SCOREFN_MAX_WAIT_S)" if over > 0 else
                         "past its deadline (SCOREFN_REQUEST_TIMEOUT_S)")
                raise QueueFull(f"this request would wait {wait:.1f} s for the device (its own work: {own:.1f} s), "
                                f"{limit}", retry_after_s=math.ceil(max(over, late)))
            entry.submitted = now
            self.admitted += 1
            (self._bulk if entry.bulk else self._normal).append(entry)
            self._cv.notify_all()
        return entry.future

    def _stretch(self) -> float:
        """How much longer normal work takes while bulk work waits beside it (lock held)."""
        return 1 / (1 - self.BULK_SHARE) if self._bulk else 1.0

    def _normal_wait_s(self) -> float:
        """Predicted seconds before a new normal request starts (lock held)."""
        return self._in_flight_s() + sum(self._seconds(e.left()) for e in self._normal) * self._stretch()

    def _bulk_wait_s(self) -> float:
        """Predicted seconds before a new bulk request starts (lock held)."""
        ahead = sum(self._seconds(e.left()) for e in self._bulk)
        share = self.BULK_SHARE if self._normal else 1.0  # of the device, while normal work waits
        return self._in_flight_s() + ahead / share

    def _seconds(self, work: Work) -> float:
        """Predicted seconds of queued work (lock held): its estimate, times how rounds have packed such estimates,
        times how much longer than predicted rounds take: the most the last rounds did, or the round on the device
        does now (the model follows the device's mean; this covers its spread, and a device shared with other work
        that slows down at once). Rounds themselves are filled by the estimates alone: no factor may change what a
        round holds."""
        return self.packing * max(self._slowdown(), max(self._overruns)) * self.model.seconds(work)

    def _slowdown(self) -> float:
        if not self._in_flight:
            return 1.0
        oldest = self._in_flight[0]
        return max(1.0, (self._clock() - oldest.started) / max(oldest.predicted_s, 1e-6))

    def _in_flight_s(self) -> float:
        """Predicted seconds until the rounds dispatched are done: what is left of the oldest one (nothing, once it
        overruns), then the others at the current slowdown."""
        if not self._in_flight:
            return 0.0
        oldest, *others = self._in_flight
        left = max(0.0, oldest.predicted_s - (self._clock() - oldest.started))
        return left + self._slowdown() * sum(r.predicted_s for r in others)

    # ---- rounds (the device thread) -------------------------------------------------------------------

    def next_round(self, coalesce_s: float = 0.0) -> Round | None:
        """The next round to dispatch, waiting for work; on an idle device, first up to `coalesce_s` for more
        requests to join it. None once stopped."""
        with self._cv:
            while True:
                while not (self._normal or self._bulk) and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return None
                if coalesce_s > 0 and not self._in_flight:
                    until = self._clock() + coalesce_s
                    while (not self._stopped and self._queued_s() < self.round_s
                           and (remaining := until - self._clock()) > 0):
                        self._cv.wait(remaining)
                slices = self._take()
                if slices:
                    work = sum((s.work for s in slices), Work())
                    if self._round_cost is not None:  # as planned: rows padded together, batches shared
                        planned = self._round_cost([s.job for s in slices])
                        self._learn_packing(self.model.seconds(planned) / max(self.model.seconds(work), 1e-9))
                        work = planned
                    round = Round(slices, work, self.model.seconds(work), self._clock())
                    self._in_flight.append(round)
                    return round
                # Nothing taken: every waiting request was dropped (the heads of both lanes always get a slice).

    def _queued_s(self) -> float:
        return sum(self.model.seconds(e.left()) for e in (*self._normal, *self._bulk))

    def _learn_packing(self, ratio: float) -> None:
        """Requests are estimated alone (their rows at their own length, a share of full batches); a round pads
        rows of different lengths together and may not fill its batches: keep the planned / estimated ratios."""
        self._packings.append(min(max(ratio, 1 / ServiceModel.MAX_RATIO), ServiceModel.MAX_RATIO))

    @property
    def packing(self) -> float:
        """The largest ratio of the last rounds: the queue is predicted as badly packed as rounds have lately been
        (it varies with the mix from round to round; a wait predicted short is a broken promise, one predicted
        long only an early 429)."""
        return max(self._packings)

    def _take(self) -> list[Slice]:
        """Fill a round (lock held): normal requests in order; the head bulk request beside them. While both lanes
        wait, normal work gets (1 - BULK_SHARE) of a round, and the bulk lane earns as credit the time normal work
        got (in the ratio of the shares), spent on a slice once it covers the smallest one (deficit round robin: a
        slice larger than its share comes every few rounds, and the lanes still split the device as the shares say)."""
        self._drop_dead()
        budget = self.round_s
        taken: list[Slice] = []
        both = bool(self._normal and self._bulk)
        kept = self.BULK_SHARE * self.round_s if both else 0.0  # of the budget, not for normal work
        normal_s = 0.0
        while self._normal and budget > kept:
            entry = self._normal[0]
            rows = self._slice_rows(entry, budget - kept, force=not taken)
            if not rows:
                break  # first come, first served: nothing overtakes the head
            spent = self._add(taken, entry, rows)
            budget -= spent
            normal_s += spent
            if entry.rows_left:
                break  # it goes on in the next round, first
            self._normal.pop(0)
            self._drop_dead()
        if not self._bulk:
            self._bulk_credit = 0.0
            return taken
        entry = self._bulk[0]
        if both:  # as much device time as normal work got, in the ratio of the shares
            self._bulk_credit += normal_s * self.BULK_SHARE / (1 - self.BULK_SHARE)
            limit, force = self._bulk_credit, self._bulk_credit >= self._smallest_s(entry)
        else:
            limit, force = budget, not taken
        rows = self._slice_rows(entry, limit, force=force)
        if rows:
            spent = self._add(taken, entry, rows)
            self._bulk_credit = max(0.0, self._bulk_credit - spent) if both else 0.0
            if not entry.rows_left:
                self._bulk.pop(0)
        return taken

    def _add(self, taken: list[Slice], entry: Entry, rows: int) -> float:
        """Put the entry's next `rows` in the round; returns their predicted seconds."""
        piece = Slice(entry, entry.next_row, entry.next_row + rows)
        taken.append(piece)
        entry.next_row += rows
        return self.model.seconds(piece.work)

    def _drop_dead(self) -> None:
        """Start the head of each lane: drop those whose client went away or whose deadline passed (lock held)."""
        for lane in (self._normal, self._bulk):
            while lane and not lane[0].started and not self._start(lane[0]):
                lane.pop(0)

    def _smallest_s(self, entry: Entry) -> float:
        return self.model.seconds(entry.shared + entry.per_row * self._smallest(entry))

    def _smallest(self, entry: Entry) -> int:
        """Rows of an entry's smallest slice: 1, or with a shared prefix (computed again for every slice) enough rows
        to cost as much as the prefix (and 2): slicing costs at most half of the device time it splits."""
        if not entry.shared.batches:
            return 1
        rows = math.ceil(self.model.seconds(entry.shared) / self.model.seconds(entry.per_row) - 1e-9)
        return min(max(2, rows), entry.rows_left)

    def _slice_rows(self, entry: Entry, limit_s: float, force: bool) -> int:
        """How many of the entry's next rows fit in `limit_s` (0: not even its smallest slice, unless forced)."""
        row_s = self.model.seconds(entry.per_row)
        smallest = self._smallest(entry)
        fits = int((limit_s - self.model.seconds(entry.shared)) // row_s)
        if fits < smallest and not force:
            return 0
        rows = max(fits, smallest)
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
        with self._cv:
            if round.error is None:
                self._overruns.append(min(max(seconds / max(round.predicted_s, 1e-6), 1.0), ServiceModel.MAX_RATIO))
                self.model.observe(round.work, seconds)
            self._in_flight.remove(round)
            if self._in_flight:  # pipelined: the next round's device work starts now at the latest
                self._in_flight[0].started = max(self._in_flight[0].started, now)
            self._cv.notify_all()
        return seconds

    def drop(self, entry: Entry) -> None:
        """A failed request: none of its other rows are computed."""
        with self._cv:
            lane = self._bulk if entry.bulk else self._normal
            if entry in lane:
                lane.remove(entry)

    # ---- life cycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._cv:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False if `timeout` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._normal or self._bulk or self._in_flight), timeout)

    def take_waiting(self) -> list[Entry]:
        """Remove and return every request still waiting (the drain's grace period is over)."""
        with self._cv:
            waiting, self._normal, self._bulk = self._normal + self._bulk, [], []
            return waiting

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def stats(self) -> dict[str, float]:
        with self._cv:
            return {"queue_depth": len(self._normal) + len(self._bulk), "queue_depth_bulk": len(self._bulk),
                    "predicted_wait_seconds": self._normal_wait_s(),
                    "backlog_seconds": self._in_flight_s() + self.packing * self._queued_s(),
                    "max_wait_seconds": self.max_wait_s, "packing": self.packing,
                    "overrun": max(self._overruns),
                    "admitted": self.admitted, "refused_wait": self.refused["wait"],
                    "refused_queue": self.refused["queue"]}
