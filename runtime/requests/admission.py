"""Admission: queue a request only while it can be answered in time, refuse it (QueueFull, with Retry-After)
otherwise, and under overload refuse every kind of request alike.

The rules (`own`: the request's device seconds run alone, its own device batches: its service time, never a wait;
`ahead`: the remaining work of the queued requests shorter than it; `inflight`: the rounds dispatched and not done;
`packing`: what busy rounds cost as planned over what their slices were priced at; OLDEST_SHARE: the oldest request's
share of a round, runtime.requests.round_builder):

    wait = inflight + packing * ahead / (1 - OLDEST_SHARE)   (the time behind other requests' work; no share taken
                                                              when the oldest request is ahead anyway)
    small (own <= max_wait / 2):  wait + own <= max_wait   (it is answered within SCOREFN_MAX_WAIT_S)
    any:     now + inflight + ahead / (1 - OLDEST_SHARE) <= deadline   (it starts before SCOREFN_REQUEST_TIMEOUT_S)
    overload (offered work `load` times what the device computes, over the last 30 s and the last 5 s, above 1):
             backlog <= BACKLOG_WAITS * max_wait; while the longest small request queued would wait over
             max_wait / 2, one request in load * packing let in whatever its kind
    small requests asking for more than the device computes over the last 5 s: a small one judged as the longest
             small request of late (within the long window)

Every rule refuses for work ahead of the request, never for its own: on an idle instance `wait` and the backlog are 0,
so every request within the limits is admitted, and a large one (own over max_wait / 2, even over max_wait) is
answered at its own pace: its promise is that it starts before its deadline while small requests keep theirs.

Queued work is priced as a share of a full device batch, as on a busy device; but a round fills batches only as far
as its budget lets it. A flood of one-item requests runs ~6 a round, in two batches of 4 rows, at 1.9x their price
(AMD EPYC, 2026-11-26). So the wait counts the work ahead at what busy rounds really cost: `packing`, the planned cost
over the slices' price of the rounds taken with work left queued behind them (a moving average, never below 1). A
round of one request alone on an idle device says nothing of what a queue costs (a one-item request alone in its
batch is ~7x its share of a full one) and teaches nothing.

The backlog is all the work admitted and not done (in flight and queued), so under overload the queue drains to it and
what was admitted before the overload was noticed is done before more is let in: once the load drops, the instance is
back to normal as soon as that backlog is done. Offered work counts each request's share of a busy device up to
SCOREFN_MAX_WAIT_S, and a request refused and sent again within the long window counts once: a client that retries
after every Retry-After does not keep an overload alive. The overload rules do not depend on the request, so under
overload every kind of request is refused in the same proportion and answered in proportion to what it asks; below
capacity they never apply, so bursts are queued, not refused. Where every request is small (a fast device), the
promise to small requests alone would refuse the longest of them first and keep the backlog under its bound: hence the
credit and the common judgment (docs/admission.md, "Overload"). Otherwise QueueFull, with Retry-After the seconds until
the work ahead is predicted to have drained enough for the rule that refused it to pass. SCOREFN_MAX_QUEUE stays a
hard cap on the number of queued requests. A small request admitted that can no longer start in time, the device
running slower than predicted, is refused when the round before it is taken. Pure Python.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Any, Callable

from runtime.interface import Prediction, QueueFull, ShuttingDown
from runtime.requests.backlog import Backlog
from runtime.requests.cost import Work
from runtime.requests.round_builder import RoundBuilder
from runtime.requests.slices import Admission, Entry


def fingerprint(job: Any) -> int:
    """Tells a request sent again from a new one: its token sequences (a Job's or a TokenJob's)."""
    return hash(tuple(map(tuple, job.sequences)))


class AdmissionControl:
    """Decides, on the request threads, which requests join the backlog's queue; counts what it refuses."""

    BACKLOG_WAITS = 4.0  # under overload, the backlog is kept within this many SCOREFN_MAX_WAIT_S
    # Offered work is averaged over two windows: an overload is a load above capacity over both the long one (many
    # requests: a burst is not an overload) and the short one (it is still going on: the load has not dropped).
    LOAD_WINDOWS_S = (30.0, 5.0)
    PENDING_S = 60.0  # how long a request without a deadline counts as about to compute what it was admitted with

    def __init__(self, backlog: Backlog, cost: Callable[[Any], Work], max_queue: int, max_wait_s: float,
                 round_s: float, slice_rows: Callable[[Any], int] | None = None,
                 alone: Callable[[Any], Work] | None = None,
                 admitted: Callable[[Any, float], None] | None = None) -> None:
        """`cost(job)`: a request's device work on a busy device (what it adds to a round); `round_s`: a round's
        budget; `slice_rows(job)`: the fewest of its rows worth a slice (default 1); `alone(job)`: its work run alone,
        its own device batches (default: `cost`); `admitted(job, until)`: told of each request queued (the scorer's
        prefix cache prices the requests after it that share its prefix as hits, until it is computed or `until`)."""
        self.backlog = backlog
        self.model = backlog.model
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.round_s = round_s
        self.backlog_limit_s = self.BACKLOG_WAITS * max_wait_s
        self.refused = {"wait": 0, "deadline": 0, "overload": 0, "queue": 0, "late": 0}
        self.admitted = 0
        self._cost = cost
        self._alone = alone or cost
        self._admitted = admitted
        self._min_rows = slice_rows or (lambda job: 1)
        self._clock = backlog.clock
        self._offered = [0.0] * len(self.LOAD_WINDOWS_S)  # decayed sums of the work asked for (each request's up to
        self._offered_at = self._clock()  # max_wait) over each window
        self._offered_small = 0.0  # the same over the short window, of the small requests alone
        self._refused_at: dict[int, float] = {}  # fingerprint -> when, for the requests refused within the long window
        self._longest_recent = (0.0, 0.0, -math.inf)  # the longest small request of late: own s, share s, when
        self._share = 1.0  # under overload, the credit of 1 / load each request adds: one is let in per whole one
        self._closed = False  # no new work

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
        alone = self._alone(job)
        shared = Work(batches=1, context=work.context) if work.context else Work()
        entry = Entry(job, deadline, request_id, shared, (work - shared) * (1 / len(job.sequences)),
                      min_rows=self._min_rows(job), trace=trace)
        # Outside the lock too (it reads every token), while refusals are remembered: is it one sent again?
        key = fingerprint(job) if self._refused_at else None
        with self.backlog.lock:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if len(self.backlog.queue) >= self.max_queue:
                self.refused["queue"] += 1
                raise QueueFull(f"{self.max_queue} requests are already waiting (SCOREFN_MAX_QUEUE)",
                                retry_after_s=self.backlog.in_flight_s() + self.round_s)
            now = self._clock()
            share = self.model.seconds(work)  # what it adds to a busy device: its place in the queue, its offer
            own = self.model.seconds(alone)
            self._forget_refusals(now)
            load = self._offer(now, 0.0 if key in self._refused_at else share, small=own <= self.max_wait_s / 2)
            entry.admission = Admission(own, self.packed_wait_s(share), load)
            try:
                self._refuse_if_late(entry, now, share)
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
            self.backlog.queue.append(entry)
            self.backlog.lock.notify_all()
        if self._admitted is not None:  # outside the lock (it reads the tokens); a round may have taken it already
            self._admitted(job, deadline if deadline is not None else now + self.PENDING_S)
        return entry

    def _refuse_if_late(self, entry: Entry, now: float, share: float) -> None:
        """Raise QueueFull when the entry cannot be answered in time (lock held); see the module's rules. The deadline
        is judged at the queued work's price (a refusal there is a bet that the request would have been dropped)."""
        own, wait, load = entry.admission.own_s, entry.admission.wait_s, entry.admission.load
        refusals = []  # (seconds over, reason, what the client is told): over is the wait to drain first
        if own <= self.max_wait_s / 2:
            judged, why = own, f"its own work: {own:.1f} s"
            longest_own, longest_share = self._longest_recent_small(own, share, now)
            if self._small_load(now) > 1.0:
                # small requests alone ask for more than the device computes, now (the short window: the long one
                # notices an overload ~9 s late; a bulk client filling the spare device time is no reason): judged
                # as the longest small request of late, so every small kind is refused alike
                wait, judged = max(wait, self.packed_wait_s(longest_share)), longest_own
                why = f"overloaded, each small request judged as the longest of late, {judged:.1f} s of work"
            if wait + judged > self.max_wait_s:
                refusals.append((wait + judged - self.max_wait_s, "wait", f"this request would wait {wait:.1f} s for "
                                 f"the device ({why}), over the limit of {self.max_wait_s:g} s (SCOREFN_MAX_WAIT_S)"))
        if entry.deadline is not None and now + (start := self.wait_s(share)) > entry.deadline:
            refusals.append((now + start - entry.deadline, "deadline", f"this request would wait {start:.1f} s for "
                             f"the device, past its deadline (SCOREFN_REQUEST_TIMEOUT_S)"))
        if load > 1.0:
            overloaded = (f"the instance is overloaded (asked for {load:.1f}x what it computes, over the last "
                          f"{max(self.LOAD_WINDOWS_S):g} s and the last {min(self.LOAD_WINDOWS_S):g} s)")
            if (backlog := self.backlog.seconds()) > self.backlog_limit_s:
                refusals.append((backlog - self.backlog_limit_s, "overload", f"{overloaded} and {backlog:.1f} s of "
                                 f"work are queued, over {self.backlog_limit_s:g} s ({self.BACKLOG_WAITS:g} x "
                                 f"SCOREFN_MAX_WAIT_S)"))
            # While small work waits (the device saturated: the longest small request would wait over half a
            # budget), one request in `load` (at what busy rounds cost) is let in, whatever its kind; once it has
            # drained, every one again, while the load (a 5 s average) still remembers the overload. A bulk request
            # left in the backlog is no reason: it runs a round's share at a time.
            elif not refusals and (queued := self._longest_queued_small()) is not None and queued > self.max_wait_s / 2:
                ratio = load * self.backlog.packing
                self._share = min(self._share + 1 / ratio, 2.0)
                if self._share < 1.0:
                    refusals.append((self.round_s, "overload", f"{overloaded}: one request in {ratio:.1f} is let in"))
                else:
                    self._share -= 1.0
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

    def _offer(self, now: float, own: float, small: bool) -> float:
        """Count a request's work (up to max_wait) as asked for; returns the offered load (lock held)."""
        asked = min(own, self.max_wait_s)
        self._offered_small = self._small_load(now) * min(self.LOAD_WINDOWS_S) + (asked if small else 0.0)
        self._offered = [sum_ * math.exp(-(now - self._offered_at) / window) + asked
                         for sum_, window in zip(self._offered, self.LOAD_WINDOWS_S)]
        self._offered_at = now
        return self.load(now)

    def load(self, now: float | None = None) -> float:
        """The offered load: device seconds asked for per second (1: as much as the device computes), the smaller of
        its averages over LOAD_WINDOWS_S."""
        return min(self._loads(now))

    def _loads(self, now: float | None = None) -> list[float]:
        """The offered load averaged over each of LOAD_WINDOWS_S."""
        elapsed = (self._clock() if now is None else now) - self._offered_at
        return [sum_ * math.exp(-elapsed / window) / window for sum_, window in zip(self._offered, self.LOAD_WINDOWS_S)]

    def _small_load(self, now: float) -> float:
        """The small requests' offered load over the short window."""
        window = min(self.LOAD_WINDOWS_S)
        return self._offered_small * math.exp(-(now - self._offered_at) / window) / window

    def wait_s(self, share: float) -> float:
        """Predicted seconds before a request of `share` seconds (its work on a busy device) starts, at the queued
        work's price: the rounds in flight, then the queued work shorter than it, at the device time the oldest
        request leaves when that one is not ahead of it (lock held)."""
        return self.backlog.in_flight_s() + self._ahead_s(share)

    def packed_wait_s(self, share: float) -> float:
        """As wait_s, with the queued work ahead at what busy rounds really cost (`packing`): the wait a small
        request is promised against (lock held)."""
        return self.backlog.in_flight_s() + self.backlog.packing * self._ahead_s(share)

    def _ahead_s(self, share: float) -> float:
        queue, left_s = self.backlog.queue, self.backlog.left_s
        ahead = sum(left for e in queue if (left := left_s(e)) <= share)
        oldest_share = RoundBuilder.OLDEST_SHARE if queue and left_s(queue[0]) > share else 0.0
        return ahead / (1 - oldest_share)

    def _longest_queued_small(self) -> float | None:
        """The wait, at what busy rounds cost, of the longest small request queued; None when none is (lock held)."""
        small = [(e.admission.own_s, self.backlog.left_s(e)) for e in self.backlog.queue
                 if e.admission is not None and e.admission.own_s <= self.max_wait_s / 2]
        return self.packed_wait_s(max(small)[1]) if small else None

    def _longest_recent_small(self, own: float, share: float, now: float) -> tuple[float, float]:
        """The longest small request of late, this one's (`own` seconds alone, `share` on a busy device) included:
        (its own seconds, its share; this one's share where that is larger). Of late: the longest asked for within the
        long load window, a one-item request judged as the 32-item ones arriving beside it (judged by its own wait,
        the longest kind waits behind every other and was refused most: 25% answered at 4x against 48% of the
        one-item ones, simulated). Lock held."""
        recent_own, recent_share, at = self._longest_recent
        if now - at > max(self.LOAD_WINDOWS_S) or own >= recent_own:
            self._longest_recent = recent_own, recent_share, at = own, share, now
        return recent_own, max(share, recent_share)

    def refuse_late(self, next_start: float) -> None:
        """Refuse (429, Retry-After) the small requests still queued that can no longer start before their
        SCOREFN_MAX_WAIT_S is up, the next round starting at `next_start` at the earliest: the device ran slower than
        predicted. They are answered at once instead of late: an admitted small request is answered within
        SCOREFN_MAX_WAIT_S and one round, with its scores or with a 429 (lock held)."""
        kept = []
        for entry in self.backlog.queue:
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
        self.backlog.queue = kept

    def close(self) -> None:
        """No new work: every request from now on is refused with ShuttingDown."""
        with self.backlog.lock:
            self._closed = True
