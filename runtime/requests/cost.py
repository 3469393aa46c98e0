"""What device work costs: the padded tokens per bucket kind and the device batches of a request (or a round), and a
running estimate of the seconds they take on this device.

    serial ~= per_batch * device batches + sum over kinds of per_token[kind] * padded tokens of that kind
    seconds ~= serial * lanes_factor(device batches)

Every device batch pays a fixed price (the weights stream through once, the launches), every padded token its
share of the matmuls; the kinds differ (a continuation also attends to its shared context, a completion row runs the
vocabulary head at every position). A CPU may run a round's batches on several launcher threads at once
(runtime.requests.launch): two of them take `overlap` times their serial seconds, where one batch alone takes its
own, so a round of one batch and a round of two are priced apart (one price for both learned the cheaper pairs and
promised rounds of one batch too early: tests/runtime/requests/test_scheduler_simulated.py). The estimate is seeded
at start-up by timing a few buckets (runtime.assembly.calibration) and then corrected after every device round by
what the round really took (`ServiceModel.observe`). Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from runtime.requests.jobs import Job, TokenJob, shared_prefix_length
from runtime.shapes.buckets import BucketPlan, fit
from runtime.shapes.layout import DeviceBatch

KINDS = ("full", "context", "continuation", "completion")


@dataclasses.dataclass(frozen=True)
class Work:
    """Device batches and padded tokens per bucket kind (floats: a slice of a request holds a share of them)."""
    batches: float = 0.0
    full: float = 0.0  # whole sequences, read at the last position
    context: float = 0.0  # a shared prefix, computed once
    continuation: float = 0.0  # items after a shared prefix
    completion: float = 0.0  # whole sequences, read at every position (/v1/completions)

    @classmethod
    def of(cls, kind: str, batches: Sequence["DeviceBatch"]) -> "Work":
        """The device batches a BucketPlan split makes, as work of one kind."""
        return cls(batches=len(batches), **{kind: float(sum(batch.padded_tokens for batch in batches))})

    @classmethod
    def shared(cls, kind: str, batches: Sequence["DeviceBatch"], full_batch: Callable[[int], int]) -> "Work":
        """Rows that other requests' rows can join in a device batch: each pays its length bucket and its share
        of a full batch (`full_batch(length)` rows), as on a busy device."""
        return cls(batches=sum(b.rows / full_batch(b.length) for b in batches),
                   **{kind: float(sum(b.rows * b.length for b in batches))})

    def vector(self) -> tuple[float, float, float, float, float]:
        return self.batches, self.full, self.context, self.continuation, self.completion

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(self.vector(), other.vector())))

    def __sub__(self, other: "Work") -> "Work":
        return Work(*(a - b for a, b in zip(self.vector(), other.vector())))

    def __mul__(self, factor: float) -> "Work":
        return Work(*(a * factor for a in self.vector()))

    @property
    def tokens(self) -> float:
        return self.full + self.context + self.continuation + self.completion


def plan_work(plan: BucketPlan, jobs: Sequence[Job | TokenJob], rope_length_limit: int | None = None,
              marginal: bool = False) -> Work:
    """The device work the scorer plans for these requests: device batches and padded tokens per kind (admission and
    the service-time estimate count in it). `marginal`: rows that share device batches with other requests' rows
    (full, completion) pay their share of a full batch, as on a busy device, not a batch of their own."""
    work, full_rows, token_rows = Work(), [], []
    for job in jobs:
        if isinstance(job, TokenJob):
            token_rows += map(len, job.sequences)
        elif shared := shared_prefix_length(plan, job, rope_length_limit):
            rests = sorted((len(seq) - shared for seq in job.sequences), reverse=True)
            work += Work(batches=1, context=fit(plan.contexts(), shared))
            work += Work.of("continuation", plan.split_suffixes(rests))
        else:
            full_rows += map(len, job.sequences)
    for kind, batches, largest in (
            ("full", plan.split_full(full_rows), lambda length: plan.layout.full_rows(plan.limits, length)),
            ("completion", plan.split_completions(token_rows),
             lambda length: plan.batch_for(length, plan.completion_batches))):
        # marginal: a device batch's share of the largest one at its length
        work += Work.shared(kind, batches, largest) if marginal else Work.of(kind, batches)
    return work


def shared_slice_rows(plan: BucketPlan, job: Job | TokenJob, rope_length_limit: int | None = None) -> int:
    """The fewest of a request's rows worth computing in one slice of it: with a shared prefix, the items of its
    first device batch after the prefix (fewer would pad that batch, or score in full: the prefix is then not worth
    sharing); otherwise 1 (rows of a slice share device batches with other requests' rows)."""
    if isinstance(job, TokenJob) or not (shared := shared_prefix_length(plan, job, rope_length_limit)):
        return 1
    return len(plan.split_suffixes([len(seq) - shared for seq in job.sequences])[0].members)


class ServiceModel:
    """Predicted device seconds of Work; corrected after each round (thread-safe: parameters are swapped whole).
    The parameters are serial prices (one batch at a time); with two lanes, two batches at once take `overlap` times
    the sum of theirs (1: no gain, 1/2: no cost to running them together). Other lane counts are priced serially:
    calibration measures pairs (runtime.requests.launch.MAX_CPU_THREADS is 2)."""

    # How far one round moves the estimate towards what it measured (in log space), and the largest correction
    # one round may ask for: a round slowed by something else (a GC pause, a noisy neighbour) moves it little.
    RATE = 0.5
    MAX_RATIO = 4.0
    FLOOR = 1e-9  # a parameter never reaches 0 (a multiplicative update could not move it back)

    def __init__(self, per_batch: float, per_token: dict[str, float], lanes: int = 1, overlap: float = 1.0) -> None:
        self._params = tuple(max(v, self.FLOOR) for v in (per_batch, *(per_token[k] for k in KINDS)))
        self.lanes = lanes
        self.overlap = min(max(overlap, 0.5), 1.0) if lanes == 2 else 1.0
        self.rounds = 0  # rounds observed since start-up

    @classmethod
    def neutral(cls) -> "ServiceModel":
        """A model for engines started without a warm-up (tests with stub scorers): 1 ms a batch, 10 us a token."""
        return cls(1e-3, dict.fromkeys(KINDS, 1e-5))

    def seconds(self, work: Work) -> float:
        return sum(p * x for p, x in zip(self._params, work.vector())) * self.lanes_factor(work.batches)

    def lanes_factor(self, batches: float) -> float:
        """Seconds of `batches` device batches over their serial seconds: pairs take `overlap` of theirs, a batch
        alone all of its own; linear between whole counts, and 1 up to one batch (a share of a batch is priced as run
        alone)."""
        if batches <= 1:
            return 1.0

        def wall(n: int) -> float:  # seconds of n whole batches, in batches
            return n // 2 * 2 * self.overlap + n % 2
        low = math.floor(batches)
        return (wall(low) + (batches - low) * (wall(low + 1) - wall(low))) / batches

    def observe(self, work: Work, seconds: float) -> None:
        """A round of this work took `seconds`: move each parameter by the share of the prediction it made."""
        params = self._params
        factor = self.lanes_factor(work.batches)
        shares = [p * x * factor for p, x in zip(params, work.vector())]
        predicted = sum(shares)
        if predicted <= 0 or seconds <= 0:
            return
        log_ratio = math.log(min(max(seconds / predicted, 1 / self.MAX_RATIO), self.MAX_RATIO))
        self._params = tuple(max(p * math.exp(self.RATE * share / predicted * log_ratio), self.FLOOR)
                             for p, share in zip(params, shares))
        self.rounds += 1

    @property
    def per_batch(self) -> float:
        return self._params[0]

    def tokens_per_second(self) -> dict[str, float]:
        """Marginal throughput per kind: padded tokens per second once batches are large."""
        return {kind: 1.0 / p for kind, p in zip(KINDS, self._params[1:])}

    def fit_plan(self, plan: "BucketPlan") -> "BucketPlan":
        """The plan with this device's price of a device batch in padded tokens (what the grid weighs against padding
        when it splits rows into batches); unchanged when the timings could not tell the two prices apart."""
        overhead = self.per_batch * self.tokens_per_second()["full"]
        return dataclasses.replace(plan, batch_overhead_tokens=overhead) if 1 <= overhead <= 65536 else plan

    def describe(self) -> str:
        rates = ", ".join(f"{kind} {rate:,.0f}" for kind, rate in self.tokens_per_second().items())
        lanes = f"; {self.lanes} batches at once in {self.overlap:.2f} of their serial time" if self.lanes > 1 else ""
        return f"{self.per_batch * 1000:.1f} ms per device batch; padded tokens/s: {rates}{lanes}"
