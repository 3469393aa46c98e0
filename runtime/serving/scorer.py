"""Scoring on precompiled buckets: plan device batches, pad, dispatch, then fetch every result at once.

Two ways to score a request's sequences, picked by padded-token cost:
- full: every sequence on its own row (rows of several requests share device batches);
- shared prefix: the longest common token prefix runs once, the items' remaining tokens then
  attend to its keys/values, with positions continuing after it.
Right padding never changes a score: real tokens attend only to earlier positions.

`dispatch` launches every device batch of a round without waiting for any (JAX dispatches asynchronously);
`collect` fetches all their outputs in one transfer. The engine plans and dispatches the next round while
the device still runs this one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from runtime.serving import packing
from runtime.serving.buckets import BucketPlan, Chunk, SequenceTooLong, fit
from runtime.serving.cost import Work, plan_work
from runtime.serving.jobs import Job, TokenJob, shared_prefix_length
from runtime.serving.executables import Executables, ExecutableStore, spec
from runtime.interface import Sampling, TokenLogprobs
from runtime.model.transformer import Llama

log = logging.getLogger("scorefn.runtime")


@dataclasses.dataclass
class _Row:
    job: int
    index: int
    tokens: Sequence[int]


@dataclasses.dataclass
class Round:
    """A dispatched round: each device batch's (still on-device) outputs and the rows it holds."""
    jobs: Sequence[Job | TokenJob]
    pending: list[tuple[object, list[_Row]]]


class Scorer:
    def __init__(self, model: Llama, plan: BucketPlan, executables: Executables | None = None,
                 lazy: bool = False, store: ExecutableStore | None = None):
        self.cfg = model.cfg
        self.plan = plan
        self.exe = executables or Executables(model, lazy=lazy, store=store)
        self.hidden_size = self.cfg.hidden_size
        self.attention_dtype = model.attention_dtype  # of the shared-prefix keys and values
        # Longer sequences change their RoPE frequencies (dynamic, longrope), so the context's keys would differ
        # from each item's own: such requests are scored in full.
        self.rope_length_limit = model.rope_length_limit
        self.device_batches = 0  # forward passes run (for /metrics: mean rows per device batch)
        self.device_rows = 0
        self.prefix_batches = 0  # of which scored after a shared prefix

    # ---- warm-up --------------------------------------------------------------------------------------

    def work(self) -> list[tuple[str, tuple, tuple]]:
        """Every (entry point, bucket, argument shapes) this scorer's plan compiles."""
        p, D = self.plan, self.hidden_size
        kv_shape = lambda c: (self.cfg.num_layers, c, self.cfg.num_kv_heads, self.cfg.head_dim)
        kv_dtype = self.attention_dtype
        work: list[tuple[str, tuple, tuple]] = []
        work += [("prefill_context", (c,), (spec((1, c)),)) for c in p.contexts()]
        if p.packing:
            def rows(r, w):  # tokens, positions, segments [r, w]; last_index [slots]
                return spec((r, w)), spec((r, w)), spec((r, w)), spec((p.packing.slots_for(r, w),))
            work += [("hidden_packed", (r, w), rows(r, w)) for r, w in p.full()]
            work += [("hidden_packed_after_context", (c, r, w),
                      (spec(kv_shape(c), kv_dtype), spec(kv_shape(c), kv_dtype), spec(()), *rows(r, w)))
                     for c, r, w in p.continuations()]
        else:
            work += [("hidden", (b, t), (spec((b, t)), spec((b,)))) for b, t in p.full()]
            work += [("hidden_after_context", (c, b, s),
                      (spec(kv_shape(c), kv_dtype), spec(kv_shape(c), kv_dtype), spec(()), spec((b, s)), spec((b,))))
                     for c, b, s in p.continuations()]
        if self.cfg.task == "causal_lm":
            work += [("label_logprobs", (b, n), (spec((b, D), np.float32), spec((b, n)))) for b, n in p.heads()]
            work += [("token_logprobs", (b, t), (spec((b, t)), spec((b,)), spec((b,), np.float32),
                                                 spec((b,), np.uint32))) for b, t in p.completions()]
        else:
            work += [("class_logits", (b,), (spec((b, D), np.float32),))
                     for b in sorted({b for b, _ in p.heads()})]
        return work

    def compile_all(self, progress: Callable[[int, str, float], None] | None = None,
                    timings: dict[tuple, float] | None = None) -> int:
        """Compile every bucket once (from the executable store, else through the persistent cache).
        Returns how many buckets there are; `progress(done, name, seconds)` after each one; `timings`, when
        given, gets each (entry point, bucket)'s seconds."""
        timings = {} if timings is None else timings
        work = self.work()
        if self.exe.store is not None and not self.exe.compile_only and (
                miss := self.exe.store.explain_miss(self.exe.fingerprint, self.exe.fingerprint_parts)):
            (log.info if "nothing stored yet" in miss else log.warning)(miss)
        # Executables in the store load without tracing, on every core (deserializing one releases the GIL: 1.5x
        # faster in two threads on 2 cores). Tracing holds the GIL, so it runs here one bucket at a time; XLA
        # compiles (or loads from the persistent cache) in a pool meanwhile, on every core.
        todo, done = [], 0
        missing = [(method, key, args) for method, key, args in work if not self.exe.has(method, key)]

        def load_one(method: str, key: tuple) -> tuple[bool, float]:
            started = time.perf_counter()
            return self.exe.load_stored(method, key), time.perf_counter() - started
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            loads = [pool.submit(load_one, method, key) for method, key, _ in missing]
            for (method, key, args), load in zip(missing, loads):
                stored, seconds = load.result()
                if not stored:
                    todo.append((method, key, args))
                    continue
                done += 1
                timings[(method, key)] = seconds
                if progress:
                    progress(done, f"{method}{key}", seconds)
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            def compile_one(method: str, key: tuple, lowered, traced: float) -> tuple[str, float]:
                started = time.perf_counter()
                self.exe.add(method, key, lowered)
                timings[(method, key)] = traced + time.perf_counter() - started
                return f"{method}{key}", timings[(method, key)]
            futures = []
            for method, key, args in todo:
                started = time.perf_counter()
                lowered = self.exe.lower(method, *args)
                futures.append(pool.submit(compile_one, method, key, lowered, time.perf_counter() - started))
            for future in concurrent.futures.as_completed(futures):
                name, seconds = future.result()
                done += 1
                if progress:
                    progress(done, name, seconds)
        return len(work)

    # ---- scoring ----------------------------------------------------------------------------------------

    def check(self, sequences: Sequence[Sequence[int]]) -> None:
        for seq in sequences:
            if len(seq) > self.plan.max_length:
                raise SequenceTooLong(len(seq), self.plan.max_length)
            if not seq:
                raise ValueError("cannot score an empty sequence: there is no position to predict from")

    def score(self, sequences: Sequence[Sequence[int]], label_ids: Sequence[int]) -> np.ndarray:
        """log P(label | sequence) at the position after each sequence: [n_sequences, n_labels] float32."""
        return self.score_jobs([Job(sequences, label_ids)])[0]

    def score_jobs(self, jobs: Sequence[Job | TokenJob]) -> list:
        """Run several requests at once; rows of requests scored in full share device batches."""
        return self.collect(self.dispatch(jobs))

    def token_logprobs(self, sequences: Sequence[Sequence[int]], sampling: Sequence[Sampling] | None = None
                       ) -> list[TokenLogprobs]:
        """Blocking convenience: per-position log-probabilities of each sequence (greedy next token by default)."""
        return self.score_jobs([TokenJob(sequences, sampling or [Sampling()] * len(sequences))])[0]

    def dispatch(self, jobs: Sequence[Job | TokenJob]) -> Round:
        """Check, plan and launch every device batch of these requests; nothing waits for the device."""
        for job in jobs:
            self.check(job.sequences)
            if isinstance(job, Job) and len(job.label_ids) > self.plan.max_labels:
                raise ValueError(f"{len(job.label_ids)} labels exceed the limit of {self.plan.max_labels}")
            if isinstance(job, TokenJob) and not self.plan.completion_batches:
                raise ValueError("this model computes no per-position log-probabilities")
        pending: list[tuple[object, list[_Row]]] = []
        full_rows: list[_Row] = []
        token_rows: list[_Row] = []
        for j, job in enumerate(jobs):
            if isinstance(job, TokenJob):
                token_rows += [_Row(j, i, seq) for i, seq in enumerate(job.sequences)]
                continue
            prefix = self._prefix_length(job.sequences)
            if prefix:
                pending += self._dispatch_shared_prefix(j, jobs, prefix)
            else:
                full_rows += [_Row(j, i, seq) for i, seq in enumerate(job.sequences)]
        pending += self._dispatch_full(full_rows, jobs)
        pending += self._dispatch_tokens(token_rows, jobs)
        return Round(jobs, pending)

    def cost(self, jobs: Sequence[Job | TokenJob], marginal: bool = False) -> Work:
        """The device work dispatch(jobs) plans (runtime.serving.cost.plan_work)."""
        return plan_work(self.plan, jobs, self.rope_length_limit, marginal)

    def collect(self, round: Round) -> list:
        """Wait for a dispatched round and fetch all its outputs in one transfer: per job, [n_sequences, n_labels]
        log-probabilities (Job) or one TokenLogprobs per sequence (TokenJob)."""
        results: list = [np.empty((len(job.sequences), len(job.label_ids)), np.float32) if isinstance(job, Job)
                         else [None] * len(job.sequences) for job in round.jobs]
        fetched = jax.device_get([output for output, _ in round.pending])
        for values, (_, rows) in zip(fetched, round.pending):
            for r, row in enumerate(rows):
                job = round.jobs[row.job]
                if isinstance(job, Job):
                    results[row.job][row.index] = values[r, : len(job.label_ids)]
                else:
                    results[row.job][row.index] = _token_logprobs(values, r, len(row.tokens))
        return results

    def _prefix_length(self, sequences: Sequence[Sequence[int]]) -> int:
        return shared_prefix_length(self.plan, sequences, self.rope_length_limit)

    def _head(self, hidden, rows: list[_Row], jobs: Sequence[Job], batch: int):
        n_labels = fit(self.plan.labels, max(len(jobs[row.job].label_ids) for row in rows))
        labels = np.zeros((batch, n_labels), np.int32)  # padding rows/columns gather label 0
        for r, row in enumerate(rows):
            ids = jobs[row.job].label_ids
            labels[r, : len(ids)] = ids
        if self.cfg.task == "causal_lm":
            return self.exe("label_logprobs", (batch, n_labels), hidden, labels)
        return self.exe("class_logits", (batch,), hidden)

    def _batches(self, rows: list[_Row], split: Callable[[list[int]], list[Chunk]]
                 ) -> Iterator[tuple[Chunk, list[_Row]]]:
        """Rows longest first (similar lengths share a batch), cut into device batches by a BucketPlan split;
        each batch is counted for /metrics once the caller has dispatched it."""
        rows = sorted(rows, key=lambda row: len(row.tokens), reverse=True)
        for chunk in split([len(row.tokens) for row in rows]):
            batch_rows = rows[chunk.start: chunk.start + chunk.rows]
            yield chunk, batch_rows
            self.device_batches += 1
            self.device_rows += len(batch_rows)

    def _dispatch_packed(self, rows: list[_Row], jobs: Sequence[Job], packs, method: str, key: Callable,
                         *context, start: int = 0) -> list[tuple[object, list[_Row]]]:
        """Packed device batches (runtime.serving.packing): each pack's rows hold several sequences; the head
        reads one slot per sequence."""
        out = []
        for pack in packs:
            tokens, positions, segments, last, order = packing.arrays(pack, [row.tokens for row in rows], start)
            batch_rows = [rows[i] for i in order]
            hidden = self.exe(method, key(pack), *context, tokens, positions, segments, last)
            out.append((self._head(hidden, batch_rows, jobs, pack.slots), batch_rows))
            self.device_batches += 1
            self.device_rows += len(batch_rows)
        return out

    def _dispatch_full(self, rows: list[_Row], jobs: Sequence[Job]) -> list[tuple[object, list[_Row]]]:
        if self.plan.packing:
            packs = self.plan.split_full([len(row.tokens) for row in rows])
            return self._dispatch_packed(rows, jobs, packs, "hidden_packed", lambda pack: (pack.rows, pack.width))
        out = []
        for chunk, batch_rows in self._batches(rows, self.plan.split_full):
            hidden = self.exe("hidden", (chunk.batch, chunk.length), *_padded(batch_rows, chunk))
            out.append((self._head(hidden, batch_rows, jobs, chunk.batch), batch_rows))
        return out

    def _dispatch_shared_prefix(self, j: int, jobs: Sequence[Job], shared: int) -> list[tuple[object, list[_Row]]]:
        p, job = self.plan, jobs[j]
        context = fit(p.contexts(), shared)
        ctx_tokens = np.zeros((1, context), np.int32)
        ctx_tokens[0, :shared] = job.sequences[0][:shared]
        ctx_k, ctx_v = self.exe("prefill_context", (context,), ctx_tokens)
        rows = [_Row(j, i, seq[shared:]) for i, seq in enumerate(job.sequences)]
        if p.packing:
            packs = p.split_suffixes([len(row.tokens) for row in rows])
            self.prefix_batches += len(packs)
            return self._dispatch_packed(rows, jobs, packs, "hidden_packed_after_context",
                                         lambda pack: (context, pack.rows, pack.width), ctx_k, ctx_v, np.int32(shared),
                                         start=shared)
        out = []
        for chunk, batch_rows in self._batches(rows, p.split_suffixes):
            hidden = self.exe("hidden_after_context", (context, chunk.batch, chunk.length),
                              ctx_k, ctx_v, np.int32(shared), *_padded(batch_rows, chunk))
            self.prefix_batches += 1
            out.append((self._head(hidden, batch_rows, jobs, chunk.batch), batch_rows))
        return out

    def _dispatch_tokens(self, rows: list[_Row], jobs: Sequence[Job | TokenJob]) -> list[tuple[object, list[_Row]]]:
        out = []
        for chunk, batch_rows in self._batches(rows, self.plan.split_completions):
            tokens, last = _padded(batch_rows, chunk)
            temperature = np.zeros((chunk.batch,), np.float32)
            seed = np.zeros((chunk.batch,), np.uint32)
            for r, row in enumerate(batch_rows):
                sampling = jobs[row.job].sampling[row.index]
                temperature[r], seed[r] = sampling.temperature, sampling.seed % 2**32
            out.append((self.exe("token_logprobs", (chunk.batch, chunk.length), tokens, last + 1, temperature, seed),
                        batch_rows))
        return out

def _token_logprobs(values, r: int, length: int) -> TokenLogprobs:
    """Row r of a fetched token_logprobs batch, cut to its sequence's length."""
    next_logprobs, top_ids, top_logprobs, next_id, next_logprob = values
    return TokenLogprobs(next_logprobs[r, : length - 1], top_ids[r, :length], top_logprobs[r, :length],
                         int(next_id[r]), float(next_logprob[r]))


def _padded(rows: list[_Row], chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens [batch, length] and each row's last real position [batch] (padding rows: 0)."""
    tokens = np.zeros((chunk.batch, chunk.length), np.int32)
    last = np.zeros((chunk.batch,), np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row.tokens)] = row.tokens
        last[r] = len(row.tokens) - 1
    return tokens, last
