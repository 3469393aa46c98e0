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
at start-up by timing a few buckets (runtime.assembly.calibration) and then refit after every device round to what
the last rounds really took (`ServiceModel.observe`). Pure Python and NumPy.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from runtime.requests.jobs import Context, Job, TokenJob, context_key, plan_context, plan_prompts
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
              marginal: bool = False, cached: Callable[[Job, int], int] | None = None,
              prompt_cached: Callable[[TokenJob, Sequence[int]], int] | None = None) -> Work:
    """The device work the scorer plans for these requests: device batches and padded tokens per kind (admission and
    the service-time estimate count in it). Requests after one context (runtime.requests.jobs.context_key) read it
    once, their items in common device batches. `marginal`: rows that share device batches with other requests'
    rows (full, completion, and items after a cached context: a prompt that repeats) pay their share of a full
    batch, as on a busy device, not a batch of their own. `cached`: the prefix cache's hits
    (runtime.requests.jobs.plan_context): a cached context is not computed; `prompt_cached`: its hits for prompts
    read at every position (runtime.requests.jobs.plan_prompts: also after a prompt the round keeps)."""
    work, full_rows, token_rows = Work(), [], []
    contexts: dict[tuple, tuple[Context, list[int]]] = {}  # context_key -> (the context, its rows' rests)
    after_prompts: dict[tuple, list[int]] = {}  # a cached or kept prompt's tokens -> the rests read after it
    prompts = [(job, seq) for job in jobs if isinstance(job, TokenJob) for seq in job.sequences]
    for (job, seq), (prompt, leader) in zip(prompts, plan_prompts(plan, prompts, rope_length_limit, prompt_cached)):
        if prompt.cached:
            key = (job.adapter, job.cache_salt, leader, tuple(seq[: prompt.length]))
            after_prompts.setdefault(key, []).append(len(seq) - prompt.length + 1)
        elif prompt.keep:
            work += Work(batches=1, completion=fit(plan.contexts(), len(seq)))
        else:
            token_rows.append(len(seq))
    for job in jobs:
        if isinstance(job, TokenJob):
            continue
        context = plan_context(plan, job, rope_length_limit, cached)
        if context.length:
            rests = contexts.setdefault(context_key(job, context), (context, []))[1]
            rests += (len(seq) - context.length for seq in job.sequences)
        else:
            full_rows += map(len, job.sequences)
    def largest_continuation(length: int) -> int:
        return plan.layout.continuation_rows(plan.limits, length)
    for context, rests in contexts.values():
        if context.extends:
            work += Work(batches=1, context=fit(plan.rest_lengths(), context.length - context.extends))
        elif not context.cached:
            work += Work(batches=1, context=fit(plan.contexts(), context.length))
        batches = plan.split_suffixes(sorted(rests, reverse=True))
        work += Work.shared("continuation", batches, largest_continuation) if marginal and context.cached \
            else Work.of("continuation", batches)
    def largest_completion(length: int) -> int:
        return plan.batch_for(length, plan.completion_batches)
    for rests in after_prompts.values():
        batches = plan.split_completion_suffixes(rests)
        work += Work.shared("completion", batches, largest_completion) if marginal else Work.of("completion", batches)
    for kind, batches, largest in (
            ("full", plan.split_full(full_rows), lambda length: plan.layout.full_rows(plan.limits, length)),
            ("completion", plan.split_completions(token_rows),
             largest_completion)):
        # marginal: a device batch's share of the largest one at its length
        work += Work.shared(kind, batches, largest) if marginal else Work.of(kind, batches)
    return work


def shared_slice_rows(plan: BucketPlan, job: Job | TokenJob, rope_length_limit: int | None = None,
                      cached: Callable[[Job, int], int] | None = None) -> int:
    """The fewest of a request's rows worth computing in one slice of it: with a shared prefix, the items of its
    first device batch after the prefix (fewer would pad that batch, or score in full: the prefix is then not worth
    sharing); otherwise 1 (rows of a slice share device batches with other requests' rows)."""
    context = plan_context(plan, job, rope_length_limit, cached)
    if not context.length or len(job.sequences) < 2:
        return 1
    return len(plan.split_suffixes([len(seq) - context.length for seq in job.sequences])[0].members)


class ServiceModel:
    """Predicted device seconds of Work; learned from the rounds run (thread-safe: parameters are swapped whole).
    The parameters are serial prices (one batch at a time); with two lanes, two batches at once take `overlap` times
    the sum of theirs (1: no gain, 1/2: no cost to running them together). Other lane counts are priced serially:
    calibration measures pairs (runtime.requests.launch.MAX_CPU_THREADS is 2).

    The prices are the least-squares fit, in relative error, of the last WINDOW rounds' serial seconds, each price a
    change of its start-up value (timed: runtime.assembly.calibration) in units of that value (a device batch's at
    least the price of BATCH_SCALE_TOKENS tokens), never below 0, the changes held near 0 with the weight of PRIOR
    rounds: rounds of different sizes tell the price of a batch from the price of its tokens, so a start whose
    timings could not (a busy host, noise: everything charged to the tokens) is corrected by the first rounds that
    can, a device that slows down (a neighbour) is priced as slow within a window, and a kind never run keeps its
    price."""

    WINDOW = 64  # rounds remembered: what the device costs now, not at start-up
    PRIOR = 0.01  # a price's change, in units of its start-up value, weighs as much as this many rounds' errors
    BATCH_SCALE_TOKENS = 64  # the unit of a device batch's price, at the least: this many full tokens' price
    MAX_RATIO = 4.0  # a round's seconds count as at most this factor off its prediction (a GC pause, a neighbour)
    FLOOR = 1e-9  # a parameter never reaches 0

    def __init__(self, per_batch: float, per_token: dict[str, float], lanes: int = 1, overlap: float = 1.0) -> None:
        self._prior = np.array([max(v, self.FLOOR) for v in (per_batch, *(per_token[k] for k in KINDS))])
        self._params = tuple(float(p) for p in self._prior)
        self._seen: collections.deque = collections.deque(maxlen=self.WINDOW)  # (work vector, serial seconds)
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
        """A round of this work took `seconds`: refit the prices to the rounds remembered."""
        predicted = self.seconds(work)
        if predicted <= 0 or seconds <= 0:
            return
        seconds = min(max(seconds, predicted / self.MAX_RATIO), predicted * self.MAX_RATIO)
        self._seen.append((work.vector(), seconds / self.lanes_factor(work.batches)))
        self._params = self._fit()
        self.rounds += 1

    def _fit(self) -> tuple[float, ...]:
        """The prices' changes from their start-up values, in units of `scale`, that minimise the rounds' relative
        errors plus PRIOR times the changes' squares (no change at all while rounds take what the start-up's prices
        predict)."""
        prior = self._prior
        scale = prior.copy()
        scale[0] = max(prior[0], self.BATCH_SCALE_TOKENS * prior[1 + KINDS.index("full")])
        vectors = np.array([vector for vector, _ in self._seen])
        seconds = np.array([serial for _, serial in self._seen])
        rows = np.vstack([vectors * scale / seconds[:, None], math.sqrt(self.PRIOR) * np.eye(len(prior))])
        targets = np.concatenate([1 - vectors @ prior / seconds, np.zeros(len(prior))])
        change = _least_squares_above(rows, targets, -prior / scale)
        return tuple(max(float(p), self.FLOOR) for p in prior + scale * change)

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


def _least_squares_above(matrix: np.ndarray, targets: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin |matrix @ x - targets| over x >= lower, by active sets (Lawson and Hanson's, for a handful of columns):
    solve for the free columns, and while one comes out below its bound, hold the lowest at it and solve again."""
    free = np.ones(matrix.shape[1], bool)
    x = lower.copy()
    while free.any():
        x = lower.copy()
        held = matrix[:, ~free] @ x[~free]
        x[free] = np.linalg.lstsq(matrix[:, free], targets - held, rcond=None)[0]
        if (x >= lower).all():
            break
        free[np.argmin(np.where(free, x - lower, np.inf))] = False
    return np.maximum(x, lower)
