"""The service model's first prices, measured at start-up: a few compiled buckets run once each through the scorer
the engine was built with (runtime.requests.cost holds the model, and corrects it after every device round)."""

from __future__ import annotations

import time

from runtime.interface import Sampling
from runtime.requests.cost import KINDS, ServiceModel, Work
from runtime.requests.jobs import Job, TokenJob
from runtime.requests.scorer import Scorer


def calibrate(scorer: Scorer, grow_until: float = 2.0, step_cap_s: float = 0.3) -> ServiceModel:
    """Seed a ServiceModel by running a few compiled buckets once each, through the scorer itself.

    Full buckets (each timed twice, the quicker run kept): the smallest one, then one of at least 4x its tokens, then
    further 4x steps while per-token work does not yet show (a run under `grow_until` times the smallest one's) and
    the next run is predicted to take at most `step_cap_s`; the smallest and the last give the per-batch and
    per-token prices. Then one completion bucket
    of about as many tokens (the vocabulary head at every position: about twice the price of a full token on the
    development CPU). A shared prefix's context and continuation start at the full price (within a third of it,
    measured) and are told apart by the rounds that run them. Where the scorer runs two batches at once (a CPU's
    launcher threads), the last full bucket runs beside the completion bucket (or the full bucket before it): their
    overlap, the seconds of both at once over the sum of each alone. On the development CPU three to five buckets; on
    an accelerator each run takes milliseconds.

    The prefix cache is set aside meanwhile: its hits would price a full bucket's second run as a cascade (a row of
    MIN_TOKENS or more is kept), and calibration's rows are no prompt a client sends.
    """
    cache, scorer.prefix_cache = scorer.prefix_cache, None
    try:
        return _calibrate(scorer, grow_until, step_cap_s)
    finally:
        scorer.prefix_cache = cache


def _calibrate(scorer: Scorer, grow_until: float, step_cap_s: float) -> ServiceModel:
    plan = scorer.plan

    def timed(*jobs) -> tuple[Work, float]:
        """The jobs' work and the quicker of two runs (the other work of a shared machine only ever adds time)."""
        work, runs = scorer.cost(jobs), []
        for _ in range(2):
            started = time.perf_counter()
            scorer.score_jobs(jobs)
            runs.append(time.perf_counter() - started)
        return work, min(runs)

    shortest = plan.lengths[0]
    small_job = Job([[1] * shortest], [0])
    small_work, small_s = timed(small_job)
    big_job, big_work, big_s = small_job, small_work, small_s
    partner = None  # a job of one batch timed alone, to run beside the big one (two lanes)
    program = plan.layout.full_program
    shapes = sorted({program.geometry(bucket)[:2] for bucket in plan.full()}, key=lambda rw: (rw[0] * rw[1], rw[0]))
    for batch, length in shapes:  # rows of `length` tokens
        tokens = batch * length
        if tokens < 4 * big_work.full or tokens > max(plan.max_tokens // 4, shortest):
            continue
        if big_work is not small_work and (big_s >= grow_until * small_s or
                                           big_s * tokens / big_work.full > step_cap_s):
            break
        partner = big_job, big_s
        big_job = Job([[2 + i % 64] + [1] * (length - 1) for i in range(batch)], [0])  # no common prefix
        big_work, big_s = timed(big_job)
    per_token = (big_s - small_s) / (big_work.full - small_work.full) if big_work.full > small_work.full else 0.0
    per_batch = small_s - per_token * small_work.full
    if per_token <= 0 or per_batch < 0:  # noise: charge everything to the tokens
        per_token, per_batch = big_s / max(big_work.full, 1.0), 0.0
    rates = dict.fromkeys(KINDS, per_token)
    completions = plan.completions()
    if completions:
        batch, length = min(completions, key=lambda b_t: (abs(b_t[0] * b_t[1] - big_work.full), b_t))
        completion = TokenJob([[1] * length] * batch, [Sampling()] * batch)
        work, seconds = timed(completion)
        rates["completion"] = max((seconds - per_batch * work.batches) / work.completion, per_token / 4)
        partner = completion, seconds
    lanes = scorer.launcher.threads
    overlap = 1.0  # one lane, or no pair to time: serial prices, as the rounds then correct them
    if lanes == 2 and partner is not None:  # a pair measures two lanes (runtime.requests.launch.MAX_CPU_THREADS)
        work, together = timed(big_job, partner[0])
        if work.batches == 2:  # not put in one batch by the plan
            overlap = together / (big_s + partner[1])
    return ServiceModel(per_batch, rates, lanes, overlap)
