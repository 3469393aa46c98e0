"""Prompts read at every position (/v1/completions, lm-evaluation-harness's log-likelihoods): how the scorer
(runtime.requests.scorer) dispatches their rows, and how a fetched row is put together.

Each prompt is planned in its round's order (runtime.requests.jobs.plan_prompts): after the part of it that a prompt
kept in the prefix cache, or one kept earlier in the same round, holds (`token_logprobs_after_context` on the rest,
from the last shared token; the shared positions' outputs are the kept prompt's), whole and kept
(`token_logprobs_context`: its keys, values and per-position outputs in one pass), or whole (`token_logprobs`, rows of
several requests in common device batches).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np

from runtime.interface import TokenLogprobs
from runtime.requests.jobs import TokenJob, plan_prompts
from runtime.requests.launch import Entries, Launched, Launcher, Run
from runtime.requests.prefix_cache import Hit, PrefixCache
from runtime.shapes.buckets import BucketPlan, fit
from runtime.shapes.programs import PROGRAMS


class RowScorer(Protocol):
    """What the prompt rows need of the scorer (runtime.requests.scorer.Scorer): its plan, prefix cache and launcher,
    the RoPE length limit, the cache's hits for prompts (held_prompt), and its count of device batches run."""
    plan: BucketPlan
    prefix_cache: PrefixCache | None
    launcher: Launcher
    rope_length_limit: int | None

    def held_prompt(self) -> Callable[[TokenJob, Sequence[int]], int] | None: ...

    def count(self, rows: int) -> None: ...


def dispatch(scorer: RowScorer, rows: list, jobs: Sequence[TokenJob], cached_tokens: list[int]) -> list[Launched]:
    """Launch the device batches of these prompt rows (runtime.requests.scorer.Row) on `scorer`; `cached_tokens`: per
    job, the tokens the cache held, added to."""
    whole, kept, after, out = [], [], {}, []
    followers: dict[int, dict[int, list]] = {}  # a kept row's index -> {tokens shared: the rows read after it}
    prompts = [(jobs[row.job], row.tokens) for row in rows]
    plans = plan_prompts(scorer.plan, prompts, scorer.rope_length_limit, scorer.held_prompt())
    for i, (row, (prompt, leader)) in enumerate(zip(rows, plans)):
        job = jobs[row.job]
        if leader is not None:
            followers.setdefault(leader, {}).setdefault(prompt.length, []).append(row)
            continue
        hit = scorer.prefix_cache.lookup(row.tokens, len(row.tokens), job.adapter, job.cache_salt, positions=True) \
            if prompt.cached else None
        if hit is not None and hit.length == prompt.length:  # else evicted since planned: computed again
            cached_tokens[row.job] += hit.length - 1
            after.setdefault((id(hit.kv[0]), hit.length), (hit, []))[1].append(row)
        elif prompt.keep:
            kept.append(i)
        else:
            whole.append(row)
    for i in kept:  # one with followers from this thread, so that they find its keys, values and outputs
        launched, hit = _kept(scorer, rows[i], jobs, now=i in followers)
        out.append(launched)
        for length, group in followers.get(i, {}).items():
            out += _after(scorer, dataclasses.replace(hit, length=length), group, jobs)
    for hit, group in after.values():
        out += _after(scorer, hit, group, jobs)
    program = PROGRAMS["token_logprobs"].name
    sequences = [row.tokens for row in whole]
    adapters = [jobs[row.job].adapter for row in whole]
    for batch in scorer.plan.split_completions([len(s) for s in sequences]):
        members = [whole[i] for i in batch.members]
        tokens, last, adapter = batch.arrays(sequences, adapters)
        arrays = (tokens, last + 1, *_sampling(members, jobs, batch.head_batch), adapter)
        out.append(scorer.launcher.launch(lambda run, batch=batch, arrays=arrays, members=members:
                                          [(run(program, batch.bucket, *arrays), members)]))
        scorer.count(len(batch.members))
    return out


def _kept(scorer: RowScorer, row, jobs: Sequence[TokenJob], now: bool = False) -> tuple[Launched, Hit | None]:
    """One prompt read at every position in a context bucket, its keys, values and outputs kept in the prefix cache
    for the prompts after it that share its leading tokens; `now`: launched from this thread, and returned as a hit
    of its whole length (the round's prompts after it read it), else None."""
    job, length = jobs[row.job], len(row.tokens)
    bucket = fit(scorer.plan.contexts(), length)  # as a shared prefix's (a kept prompt fits one of the kept ones)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :length] = row.tokens
    arrays = (tokens, np.full((1,), length, np.int32), *_sampling([row], jobs, 1), np.full((1,), job.adapter, np.int32))
    cache = scorer.prefix_cache
    held: list[Hit] = []

    def read_and_keep(run: Run) -> Entries:
        k, v, *outputs = run("token_logprobs_context", (bucket,), *arrays)
        cache.insert(row.tokens, length, (k, v), bucket, job.adapter, job.cache_salt, tuple(outputs[:3]))
        held.append(Hit(length, (k, v), bucket, tuple(outputs[:3])))
        return [(tuple(outputs), [row])]
    scorer.count(1)
    launched = scorer.launcher.launch(read_and_keep, now=now)
    return launched, held[0] if now else None


def _after(scorer: RowScorer, hit: Hit, rows: list, jobs: Sequence[TokenJob]) -> list[Launched]:
    """Prompts whose first `hit.length` tokens a kept prompt holds: the last of those and the rest read after the
    cached keys and values, the positions before it from the cache's outputs."""
    start = hit.length - 1
    rests = [row.tokens[start:] for row in rows]
    program = PROGRAMS["token_logprobs_after_context"].name
    out = []
    for batch in scorer.plan.split_completion_suffixes([len(rest) for rest in rests]):
        members = [dataclasses.replace(rows[i], cached=start) for i in batch.members]
        tokens, last, adapter = batch.arrays(rests, [jobs[row.job].adapter for row in rows])
        arrays = (tokens, last + 1, *_sampling(members, jobs, batch.head_batch), adapter)

        def read(run: Run, batch=batch, arrays=arrays, members=members) -> Entries:
            outputs = run(program, (hit.context, *batch.bucket), *hit.kv, np.int32(start), *arrays)
            return [((*outputs, *hit.positions), members)]
        out.append(scorer.launcher.launch(read, after=hit.kv))
        scorer.count(len(batch.members))
    return out


def _sampling(members: Sequence, jobs: Sequence[TokenJob], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's sampling temperature [rows] and seed [rows] (uint32; padding rows: 0, the most likely token)."""
    temperature = np.zeros((rows,), np.float32)
    seed = np.zeros((rows,), np.uint32)
    for r, row in enumerate(members):
        sampling = jobs[row.job].sampling[row.index]
        temperature[r], seed[r] = sampling.temperature, sampling.seed % 2**32
    return temperature, seed


def token_logprobs(values, r: int, length: int, cached: int = 0) -> TokenLogprobs:
    """Row r of a fetched batch of per-position outputs, cut to its prompt's length; with `cached`, a row of the rest
    of a prompt after its first `cached` positions, whose outputs follow the batch's (the cache's, [1, context, ...])."""
    next_logprobs, top_ids, top_logprobs, next_id, next_logprob = values[:5]
    rest = length - cached
    own = next_logprobs[r, : rest - 1], top_ids[r, :rest], top_logprobs[r, :rest]
    if cached:
        own = tuple(np.concatenate([held[0, :cached], mine]) for held, mine in zip(values[5:], own))
    return TokenLogprobs(*own, int(next_id[r]), float(next_logprob[r]))
