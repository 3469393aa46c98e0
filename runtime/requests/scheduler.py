"""Admission and device rounds: answer small requests fast, refuse only what cannot be answered in time, and under
overload refuse every kind of request alike.

Requests are weighed in predicted device seconds of their padded tokens (runtime.requests.cost), never by count. A
request's *own* work is its estimate alone; *small* requests (own work within half of SCOREFN_MAX_WAIT_S) are those
whose latency the budget bounds.

Rounds. A device round holds up to `round_s` (a quarter of SCOREFN_MAX_WAIT_S, at most SCOREFN_MAX_ROUND_S) of
predicted work: its requests are answered when all of it is done and a new small request waits for the round in
flight, so longer rounds would only delay answers (shorter ones pay their device batches' price more often). Work is
taken shortest predicted remaining work first (ties: first come, first served), so a one-item request waits for the
round in flight and for other small work, never for all of a 1,024-item one; large requests run in slices of their
rows, each large enough that its device batch and its shared prefix cost little next to its rows (a slice larger
than what is left of the budget is still taken while half of it is left). The request that has waited longest gets
OLDEST_SHARE of the device time of every round it is not in (a credit spent on its next slice), so the largest
request moves on however much smaller work keeps arriving; one that has waited half of its deadline without starting
starts in the next round.

Admission (`own`: the request's work; `ahead`: the remaining work of the queued requests shorter than it; `inflight`:
the rounds dispatched and not done; `packing`: what rounds cost as planned over what their slices were priced at):

    wait = inflight + ahead / (1 - OLDEST_SHARE)  (no share taken when the oldest request is ahead anyway)
    small:   inflight + packing * (ahead / (1 - OLDEST_SHARE) + own) <= max_wait
                                               (it is answered within SCOREFN_MAX_WAIT_S)
    any:     now + wait <= deadline            (it starts before SCOREFN_REQUEST_TIMEOUT_S)
    overload (offered work above the device's capacity over the last 30 s and the last 5 s):
             backlog <= BACKLOG_WAITS * max_wait

Work is priced as a share of a full device batch, as on a busy device; but a round fills batches only as far as its
budget lets it. A flood of one-item requests runs ~6 a round, in two batches of 4 rows, at 1.9x their price, and they
waited 1.6x their predicted wait (p50 3.6 s for 2 s; AMD EPYC, 2026-11-26). So the promise to small requests counts the
work ahead of them at what rounds really cost: `packing`, the rounds' planned cost over their slices' price, a moving
average over the last rounds (never below 1). The other rules keep the price: they bound work, not a wait.

The backlog is all the work admitted and not done (in flight and queued), so under overload the queue drains to it and
what was admitted before the overload was noticed is done before more is let in: once the load drops, the instance is
back to normal as soon as that backlog is done. Offered work counts each request's up to SCOREFN_MAX_WAIT_S, and a
request refused and sent again within the long window counts once: a client that retries after every Retry-After does
not keep an overload alive. The overload rule does not depend on the request, so under overload every kind of request
is refused in the same proportion and answered in proportion to what it asks; below capacity it never applies, so
bursts are queued, not refused. Otherwise QueueFull, with the seconds until the work ahead has drained enough as
Retry-After. SCOREFN_MAX_QUEUE stays a hard cap on the number of queued requests. Pure Python: the scorer is reached
through `cost`, `round_cost` and the jobs it is given.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Any, Callable

from runtime.interface import DeadlineExceeded, Prediction, QueueFull, ShuttingDown
from runtime.requests.cost import ServiceModel, Work
from runtime.requests.slices import Admission, Entry, Round, Slice


def fingerprint(job: Any) -> int:
    """Tells a request sent again from a new one: its token sequences (a Job's or a TokenJob's)."""
    return hash(tuple(map(tuple, job.sequences)))


def round_budget(max_wait_s: float, max_round_s: float) -> float:
    """The predicted seconds of work a device round holds: a quarter of SCOREFN_MAX_WAIT_S, at most
    SCOREFN_MAX_ROUND_S."""
    return min(max_wait_s / 4, max_round_s)


class Scheduler:
    OLDEST_SHARE = 0.1  # of the device time of a round, for the request waiting longest
    SLICE_OVERHEAD = 0.5  # a slice's device batch may add at most this to the price of each of its rows
    BACKLOG_WAITS = 4.0  # under overload, the backlog is kept within this many SCOREFN_MAX_WAIT_S
    # Offered work is averaged over two windows: an overload is a load above capacity over both the long one (many
    # requests: a burst is not an overload) and the short one (it is still going on: the load has not dropped).
    LOAD_WINDOWS_S = (30.0, 5.0)
    PACKING_RATE = 0.2  # how far one round moves `packing` towards what it measured

    def __init__(self, model: ServiceModel, cost: Callable[[Any], Work], max_queue: int, max_wait_s: float,
                 max_round_s: float, round_cost: Callable[[list], Work] | None = None,
                 clock: Callable[[], float] = time.monotonic, slice_rows: Callable[[Any], int] | None = None) -> None:
        """`cost(job)`: a request's device work on a busy device (what it adds to a round); `round_cost(jobs)`: the
        work of a round as the scorer plans it (default: the sum of its slices'); `slice_rows(job)`: the fewest of
        its rows worth a slice (default 1)."""
        self.model = model
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.round_s = round_budget(max_wait_s, max_round_s)
        self.backlog_limit_s = self.BACKLOG_WAITS * max_wait_s
        self.refused = {"wait": 0, "deadline": 0, "overload": 0, "queue": 0, "late": 0}
        self.admitted = 0
        self._cost = cost
        self._round_cost = round_cost
        self._min_rows = slice_rows or (lambda job: 1)
        self._clock = clock
        self._queue: list[Entry] = []  # admitted, not finished, in order of arrival
        self._in_flight: list[Round] = []
        self._credit = 0.0  # device seconds the oldest request has earned and not yet spent
        self._packing = 1.0  # rounds' planned cost over their slices' priced work (a moving average)
        self._rounds = 0  # taken so far
        self._offered = [0.0] * len(self.LOAD_WINDOWS_S)  # decayed sums of the work asked for (each request's up to
        self._offered_at = clock()  # max_wait) over each window
        self._refused_at: dict[int, float] = {}  # fingerprint -> when, for the requests refused within the long window
        self._cv = threading.Condition()
        self._closed = False  # no new work
        self._stopped = False  # next_round() answers None

    # ---- admission (request threads) ------------------------------------------------------------------

    def admit(self, job: Any, deadline: float | None, request_id: str | None,
              trace: Any = None) -> concurrent.futures.Future:
        """Queue a request, or raise QueueFull (or ShuttingDown); `trace` (runtime.requests.spans.RequestTrace) is told
        the decision."""
        try:
            entry = self._admit(job, deadline, request_id, trace)
        except Exception as refusal:
            if trace is not None:
                trace.refused(refusal)
            raise
        if trace is not None:
            trace.admitted(entry.admission)
        return entry.future

    def _admit(self, job: Any, deadline: float | None, request_id: str | None, trace: Any) -> Entry:
        work = self._cost(job)  # outside the lock: finding a shared prefix reads every sequence
        shared = Work(batches=1, context=work.context) if work.context else Work()
        entry = Entry(job, deadline, request_id, shared, (work - shared) * (1 / len(job.sequences)),
                      min_rows=self._min_rows(job), trace=trace)
        # Outside the lock too (it reads every token), while refusals are remembered: is it one sent again?
        key = fingerprint(job) if self._refused_at else None
        with self._cv:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                self.refused["queue"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting (SCOREFN_MAX_QUEUE)",
                                retry_after_s=self._in_flight_s() + self.round_s)
            now = self._clock()
            own = self.model.seconds(work)
            self._forget_refusals(now)
            load = self._offer(now, 0.0 if key in self._refused_at else own)
            entry.admission = Admission(own, self._wait_s(own), load)
            try:
                self._refuse_if_late(entry, now)
            except QueueFull:
                key = fingerprint(job) if key is None else key
                self._refused_at.pop(key, None)  # to the end: the dict stays in order of refusal
                self._refused_at[key] = now
                raise
            self._refused_at.pop(key, None)
            entry.submitted = now
            self.admitted += 1
            if trace is not None:
                trace.queued()
            self._queue.append(entry)
            self._cv.notify_all()
        return entry

    def _refuse_if_late(self, entry: Entry, now: float) -> None:
        """Raise QueueFull when the entry cannot be answered in time (lock held); see the module's rules."""
        own, wait, load = entry.admission.own_s, entry.admission.wait_s, entry.admission.load
        refusals = []  # (seconds over, reason, what the client is told)
        if own <= self.max_wait_s / 2 and (wait := self._packed_wait_s(own)) + own > self.max_wait_s:
            refusals.append((wait + own - self.max_wait_s, "wait", f"this request would wait {wait:.1f} s for the "
                             f"device (its own work: {own:.1f} s), over the limit of {self.max_wait_s:g} s "
                             f"(SCOREFN_MAX_WAIT_S)"))
        if entry.deadline is not None and now + wait > entry.deadline:
            refusals.append((now + wait - entry.deadline, "deadline", f"this request would wait {wait:.1f} s for "
                             f"the device, past its deadline (SCOREFN_REQUEST_TIMEOUT_S)"))
        if load > 1.0 and (backlog := self._backlog_s()) > self.backlog_limit_s:
            refusals.append((backlog - self.backlog_limit_s, "overload", f"the instance is overloaded (asked for "
                             f"{load:.1f}x what it computes, over the last {max(self.LOAD_WINDOWS_S):g} s and the last "
                             f"{min(self.LOAD_WINDOWS_S):g} s) and {backlog:.1f} s of work are queued, over "
                             f"{self.backlog_limit_s:g} s ({self.BACKLOG_WAITS:g} x SCOREFN_MAX_WAIT_S)"))
        if refusals:
            over, reason, message = max(refusals)
            self.refused[reason] += 1
            raise QueueFull(message, retry_after_s=over, reason=reason, predicted=Prediction(wait, own))

    def _forget_refusals(self, now: float) -> None:
        """Forget the refusals older than the long window, oldest first: the dict is in order of refusal (lock held)."""
        since = now - max(self.LOAD_WINDOWS_S)
        expired = []
        for key, at in self._refused_at.items():  # reads only the expired ones and the first one kept
            if at > since:
                break
            expired.append(key)
        for key in expired:
            del self._refused_at[key]

    def _offer(self, now: float, own: float) -> float:
        """Count a request's work (up to max_wait) as asked for; returns the offered load (lock held)."""
        self._offered = [sum_ * math.exp(-(now - self._offered_at) / window) + min(own, self.max_wait_s)
                         for sum_, window in zip(self._offered, self.LOAD_WINDOWS_S)]
        self._offered_at = now
        return self.load(now)

    def load(self, now: float | None = None) -> float:
        """The offered load: device seconds asked for per second (1: as much as the device computes), the smaller of
        its averages over LOAD_WINDOWS_S."""
        elapsed = (self._clock() if now is None else now) - self._offered_at
        return min(sum_ * math.exp(-elapsed / window) / window
                   for sum_, window in zip(self._offered, self.LOAD_WINDOWS_S))

    def _wait_s(self, own: float) -> float:
        """Predicted seconds before a request of `own` seconds starts: the rounds in flight, then the queued work
        shorter than it, at the device time the oldest request leaves when that one is not ahead of it (lock held)."""
        ahead = sum(left for e in self._queue if (left := self._left_s(e)) <= own)
        share = self.OLDEST_SHARE if self._queue and self._left_s(self._queue[0]) > own else 0.0
        return self._in_flight_s() + ahead / (1 - share)

    def _left_s(self, entry: Entry) -> float:
        return self.model.seconds(entry.left())

    def _backlog_s(self) -> float:
        """The work admitted and not done (lock held)."""
        return self._in_flight_s() + self._queued_s()

    def _packed_wait_s(self, own: float) -> float:
        """A small request's wait with the work ahead of it (and its own, less its price) at what rounds really cost
        (lock held): so that wait + own <= max_wait is the promise, not half of it."""
        return self._packing * self._wait_s(own) - (self._packing - 1) * (self._in_flight_s() - own)

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
                while not self._queue and not self._stopped:
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
                        priced = self.model.seconds(work)
                        work = self._round_cost([s.job for s in slices])
                        if priced > 0:
                            packing = max(1.0, self.model.seconds(work) / priced)
                            self._packing += self.PACKING_RATE * (packing - self._packing)
                    self._rounds += 1
                    round = Round(slices, work, self.model.seconds(work), self._clock(), self._rounds)
                    self._in_flight.append(round)
                    self._refuse_late(round.started + self._in_flight[0].predicted_s)
                    return round
                # Nothing taken: every queued request was dropped (cancelled, or past its deadline).

    def _queued_s(self) -> float:
        return sum(self._left_s(e) for e in self._queue)

    def _take(self) -> list[Slice]:
        """Fill a round (lock held): shortest remaining work first, slices of the rest up to the round's budget,
        and the oldest request's slice once its credit pays for one."""
        self._drop_dead()
        if not self._queue:
            return []
        now = self._clock()
        late = [e for e in self._queue if not e.started and e.deadline is not None
                and now > (e.submitted + e.deadline) / 2]  # half its time to the deadline gone: it starts now
        order = late + sorted((e for e in self._queue if e not in late), key=lambda e: (self._left_s(e), e.submitted))
        oldest = self._queue[0]
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
        self._queue = [e for e in self._queue if e.rows_left and not e.future.cancelled()]
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
        for entry in self._queue:
            if not entry.started and entry.future.cancelled():
                continue
            if not entry.started and entry.deadline is not None and now > entry.deadline:
                entry.future.set_exception(DeadlineExceeded(
                    f"waited {now - entry.submitted:.2f} s in the queue, past the request deadline"))
                if entry.trace is not None:
                    entry.trace.left_queue(None, time.time_ns())
                continue
            kept.append(entry)
        self._queue = kept

    def _refuse_late(self, next_start: float) -> None:
        """Refuse (429, Retry-After) the small requests still queued that can no longer start before their
        SCOREFN_MAX_WAIT_S is up, the next round starting at `next_start` at the earliest: the device ran slower than
        predicted. They are answered at once instead of late: an admitted small request is answered within
        SCOREFN_MAX_WAIT_S and one round, with its scores or with a 429 (lock held)."""
        kept = []
        for entry in self._queue:
            admission = entry.admission
            if (entry.started or admission is None or admission.own_s > self.max_wait_s / 2
                    or next_start <= entry.submitted + self.max_wait_s):
                kept.append(entry)
                continue
            self.refused["late"] += 1
            waited = self._clock() - entry.submitted
            entry.future.set_exception(QueueFull(
                f"this request waited {waited:.1f} s and could not start within {self.max_wait_s:g} s "
                f"(SCOREFN_MAX_WAIT_S): the device ran slower than predicted", retry_after_s=self.round_s,
                reason="late", predicted=Prediction(admission.wait_s, admission.own_s)))
            if entry.trace is not None:
                entry.trace.left_queue(None, time.time_ns())
        self._queue = kept

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
        with self._cv:
            if round.error is None:
                self.model.observe(round.work, seconds)
            self._in_flight.remove(round)
            if self._in_flight:  # pipelined: the next round's device work starts now at the latest
                self._in_flight[0].started = max(self._in_flight[0].started, now)
            self._cv.notify_all()
        return seconds

    def drop(self, entry: Entry) -> None:
        """A failed request: none of its other rows are computed."""
        with self._cv:
            if entry in self._queue:
                self._queue.remove(entry)

    # ---- life cycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        with self._cv:
            self._closed = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight; False if `timeout` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._queue or self._in_flight), timeout)

    def take_waiting(self) -> list[Entry]:
        """Remove and return every request still queued (the drain's grace period is over)."""
        with self._cv:
            waiting, self._queue = self._queue, []
            return waiting

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def stats(self) -> dict[str, float]:
        with self._cv:
            return {"queue_depth": len(self._queue),
                    "predicted_wait_seconds": self._wait_s(0.0),
                    "backlog_seconds": self._backlog_s(), "packing": self._packing,
                    "load": self.load(), "max_wait_seconds": self.max_wait_s,
                    "admitted": self.admitted, **{f"refused_{reason}": n for reason, n in self.refused.items()}}
