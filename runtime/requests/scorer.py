"""Scoring on precompiled buckets: plan a round's device batches, dispatch them, then fetch every result at once.

Two ways to score a request's sequences, picked by padded-token cost (runtime.requests.jobs):
- full: every sequence in a device batch of whole sequences (rows of several requests share them);
- shared prefix: the longest common token prefix runs once, the items' remaining tokens then attend to its
  keys/values, with positions continuing after it.
How rows are laid out in device batches is the plan's bucket layout (runtime.shapes.layout); padding never changes a
score: real tokens attend only to earlier positions of their own sequence.

`dispatch` launches every device batch of a round without waiting for any (runtime.requests.launch: JAX dispatches
asynchronously, or launcher threads run the batches side by side); `collect` fetches all their outputs in one
transfer. The engine plans and dispatches the next round while the device still runs this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import jax
import numpy as np

from runtime.interface import Sampling, TokenLogprobs
from runtime.requests import prompt_rows
from runtime.requests.cost import Work, plan_work, shared_slice_rows
from runtime.requests.jobs import Context, Job, TokenJob, context_key, plan_context
from runtime.requests.launch import Entries, Launched, Launcher, Run
from runtime.requests.prefix_cache import Hit, PrefixCache
from runtime.requests.rounds import RoundScorer
from runtime.shapes.buckets import BucketPlan, SequenceTooLong, fit
from runtime.shapes.layout import DeviceBatch


@dataclasses.dataclass
class Row:
    job: int  # index of its request in the round
    index: int  # its index in the request
    tokens: Sequence[int]
    targets: Sequence[int] | None = None  # a label of several tokens its last positions predict (Job.targets)
    # A prompt read at every position after its first `cached` positions: their outputs are the prefix cache's
    cached: int = 0


@dataclasses.dataclass
class Dispatched:
    """A dispatched round: its device batches, in launch order, each with its (still on-device) outputs and the rows
    each answers."""
    jobs: Sequence[Job | TokenJob]
    launched: list[Launched]
    cached_tokens: list[int] = dataclasses.field(default_factory=list)  # per job: its rows' tokens the cache held

    @property
    def buckets(self) -> list[str]:
        """Each program run and its bucket, batch by batch in launch order (traces name them; once collected)."""
        return [program for batch in self.launched for program in batch.programs]


class Programs(Protocol):
    """What a scorer needs of the compiled programs (runtime.assembly.executables.Executables builds them): one run
    on a bucket, the model they were compiled from (its config and RoPE length limit), and the compiles counted."""
    model: Any
    compiles: int

    def backend_compiles(self) -> int: ...

    def __call__(self, program: str, bucket: tuple, *args) -> Any: ...


class Scorer(RoundScorer):
    def __init__(self, plan: BucketPlan, executables: Programs, concurrent_batches: int = 1,
                 prefix_cache: PrefixCache | None = None):
        """`concurrent_batches`: device batches run at once (the platform's: runtime.requests.launch);
        `prefix_cache`: contexts kept across requests (runtime.requests.prefix_cache), None: none."""
        self.plan = plan
        self.prefix_cache = prefix_cache
        self.exe = executables
        # Through self.exe as it is when a batch runs: a caller may wrap it (tests record the programs run).
        self.launcher = Launcher(lambda *call: self.exe(*call), concurrent_batches)
        self.task = executables.model.cfg.task  # causal_lm | sequence_classification
        # Longer sequences change their RoPE frequencies (dynamic, longrope), so the context's keys would differ
        # from each item's own: such requests are scored in full.
        self.rope_length_limit = executables.model.rope_length_limit
        self.device_batches = 0  # forward passes run (for /metrics: mean rows per device batch)
        self.device_rows = 0
        self.prefix_batches = 0  # of which scored after a shared prefix

    @property
    def cfg(self):
        """The model's config (runtime.model.config.ModelConfig)."""
        return self.exe.model.cfg

    def check(self, sequences: Sequence[Sequence[int]]) -> None:
        for seq in sequences:
            if len(seq) > self.plan.max_length:
                raise SequenceTooLong(len(seq), self.plan.max_length)
            if not seq:
                raise ValueError("cannot score an empty sequence: there is no position to predict from")

    # ---- conveniences (tests, the benchmark, calibration) -------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], label_ids: Sequence[int]) -> np.ndarray:
        """log P(label | sequence) at the position after each sequence: [n_sequences, n_labels] float32."""
        return self.score_jobs([Job(sequences, label_ids)])[0]

    def token_logprobs(self, sequences: Sequence[Sequence[int]], sampling: Sequence[Sampling] | None = None
                       ) -> list[TokenLogprobs]:
        """Per-position log-probabilities of each sequence (greedy next token by default)."""
        return self.score_jobs([TokenJob(sequences, sampling or [Sampling()] * len(sequences))])[0]

    def score_jobs(self, jobs: Sequence[Job | TokenJob]) -> list:
        """Run several requests at once; rows of requests scored in full share device batches."""
        return self.collect(self.dispatch(jobs))

    # ---- plan, dispatch, collect ---------------------------------------------------------------------------

    def cost(self, jobs: Sequence[Job | TokenJob], marginal: bool = False) -> Work:
        """The device work dispatch(jobs) plans (runtime.requests.cost.plan_work)."""
        return plan_work(self.plan, jobs, self.rope_length_limit, marginal, self._held(pending=marginal),
                         self.held_prompt())

    def slice_rows(self, job: Job | TokenJob) -> int:
        """The fewest rows of a request worth computing in one slice (runtime.requests.cost.shared_slice_rows)."""
        return shared_slice_rows(self.plan, job, self.rope_length_limit, self._held())

    def expect(self, job: Job | TokenJob, until: float) -> None:
        """An admitted request that will compute a context and keep it: the requests after it that share it are priced
        as hits on a busy device (cost(marginal=True)) until it does, or until `until`."""
        if self.prefix_cache is not None and (context := self._context(job)).keep:
            self.prefix_cache.expect(job.sequences[0], context.length, job.adapter, job.cache_salt, until)

    def _held(self, pending: bool = False):
        """How many of a job's first `limit` tokens the prefix cache holds (plan_context's `cached`), or None; with
        `pending`, also those an admitted request will keep."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return lambda job, limit: cache.peek(job.sequences[0], limit, job.adapter, job.cache_salt, pending)

    def held_prompt(self):
        """How many of a prompt's leading tokens the prefix cache holds with their per-position outputs
        (plan_completion's `cached`), or None."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return lambda job, tokens: cache.peek(tokens, len(tokens), job.adapter, job.cache_salt, positions=True)

    def _context(self, job: Job | TokenJob) -> Context:
        return plan_context(self.plan, job, self.rope_length_limit, self._held())

    def dispatch(self, jobs: Sequence[Job | TokenJob]) -> Dispatched:
        """Check, plan and launch every device batch of these requests; nothing waits for the device."""
        for job in jobs:
            self.check(job.sequences)
            if isinstance(job, TokenJob) and not self.plan.completion_batches:
                raise ValueError("this model computes no per-position log-probabilities")
        launched: list[Launched] = []
        full_rows: list[Row] = []
        token_rows: list[Row] = []
        cached_tokens = [0] * len(jobs)
        contexts: dict[tuple, tuple[Context, list[Row]]] = {}  # requests after one context read it once
        for j, job in enumerate(jobs):
            targets = getattr(job, "targets", None) or [None] * len(job.sequences)
            rows = [Row(j, i, seq, target) for i, (seq, target) in enumerate(zip(job.sequences, targets))]
            if isinstance(job, TokenJob):
                token_rows += rows
            elif (context := self._context(job)).length:
                contexts.setdefault(context_key(job, context), (context, []))[1].extend(rows)
            else:
                full_rows += rows
        for context, rows in contexts.values():
            job = jobs[rows[0].job]
            reads = context.extends or (context.length if context.cached else 0)  # what it reads from the cache
            hit = self.prefix_cache.lookup(rows[0].tokens, reads, job.adapter, job.cache_salt) if reads else None
            if hit is not None and hit.length == reads:  # else evicted since planned: computed again
                for row in rows:
                    cached_tokens[row.job] += hit.length
                launched += self._dispatch_after_prefix(rows, jobs, context.length, hit=hit, keep=context.keep)
            else:
                launched += self._dispatch_after_prefix(rows, jobs, context.length, keep=context.keep or context.cached)
        launched += self._dispatch_full(full_rows, jobs)
        launched += self._dispatch_tokens(token_rows, jobs, cached_tokens)
        return Dispatched(jobs, launched, cached_tokens)

    def counters(self) -> dict[str, int]:
        """Programs compiled since the start (requests never compile), the device batches and rows run, and the prefix
        cache's counts (runtime.requests.prefix_cache) when there is one."""
        cache = self.prefix_cache.stats() if self.prefix_cache is not None else {}
        return {"compiles": self.exe.compiles, "backend_compiles": self.exe.backend_compiles(),
                "device_batches": self.device_batches, "device_batch_sequences": self.device_rows, **cache}

    def collect(self, dispatched: Dispatched) -> list:
        """Wait for a dispatched round and fetch all its outputs in one transfer: per job, [n_sequences, n_labels]
        log-probabilities (Job) or one TokenLogprobs per sequence (TokenJob)."""
        jobs = dispatched.jobs
        results: list = [np.empty((len(job.sequences), self._width(job)), np.float32) if isinstance(job, Job)
                         else [None] * len(job.sequences) for job in jobs]
        entries = [entry for batch in dispatched.launched for entry in batch.entries()]
        fetched = jax.device_get([output for output, _ in entries])
        for values, (_, rows) in zip(fetched, entries):
            for r, row in enumerate(rows):
                if row is None:  # a slot another head of the same device batch reads
                    continue
                job = jobs[row.job]
                if isinstance(job, Job):
                    results[row.job][row.index] = values[r, : self._width(job)]
                else:
                    results[row.job][row.index] = prompt_rows.token_logprobs(values, r, len(row.tokens), row.cached)
        return results

    def _width(self, job: Job) -> int:
        """Values a row of a job reads: its labels', or the tail of a label of several tokens."""
        return self.plan.label_tokens if job.targets is not None else len(job.label_ids)

    def _with_targets(self, batch: DeviceBatch, arrays: tuple, rows: list[Row]) -> tuple:
        """A device batch's token arguments with its rows' targets before the adapters (which come last)."""
        targets = [row.targets for row in rows] if any(row.targets for row in rows) else None
        return *arrays[:-1], batch.targets(targets, self.plan.label_tokens), arrays[-1]

    def _dispatch_full(self, rows: list[Row], jobs: Sequence[Job]) -> list[Launched]:
        program = self.plan.layout.full_program.name
        sequences = [row.tokens for row in rows]
        adapters = [jobs[row.job].adapter for row in rows]
        out = []
        for batch in self.plan.split_full([len(s) for s in sequences]):
            arrays = self._with_targets(batch, batch.arrays(sequences, adapters), rows)

            def forward_and_heads(run: Run, batch=batch, arrays=arrays) -> Entries:
                return self._read(run, *run(program, batch.bucket, *arrays), batch, rows, jobs)
            out.append(self.launcher.launch(forward_and_heads))
            self.count(len(batch.members))
        return out

    def _dispatch_after_prefix(self, rows: list[Row], jobs: Sequence[Job], shared: int, hit: Hit | None = None,
                               keep: bool = False) -> list[Launched]:
        """Rows after a context of their `shared` leading tokens: its keys and values from the prefix cache (`hit`:
        the rows of every request that found it), computed past the `hit` the cache holds of it, or computed whole
        from the first row (one request's: they are its adapter's); kept in the cache when `keep`. Then the rows'
        device batches attending them."""
        job = jobs[rows[0].job]
        out: list[Launched] = []
        adapter = np.full((1,), job.adapter, np.int32)  # the context is the first row's request's
        if hit is not None and hit.length == shared:
            context_kv, bucket = list(hit.kv), hit.context
        else:
            context_kv, (name, its_bucket, args), bucket = [], *context_program(self.plan, rows[0].tokens, shared, hit)
            cache = self.prefix_cache if keep else None
            tokens = list(rows[0].tokens[:shared])

            def prefill(run: Run) -> Entries:
                context_kv.extend(run(name, its_bucket, *args, adapter))
                if cache is not None:
                    cache.insert(tokens, shared, tuple(context_kv), bucket, job.adapter, job.cache_salt)
                return []
            out.append(self.launcher.launch(prefill, now=True))  # the batches after it read its keys and values
        program = self.plan.layout.continuation_program.name
        items = [row.tokens[shared:] for row in rows]
        for batch in self.plan.split_suffixes([len(s) for s in items]):
            arrays = self._with_targets(batch, batch.arrays(items, [job.adapter] * len(items), start=shared), rows)

            def forward_and_heads(run: Run, batch=batch, arrays=arrays) -> Entries:
                outputs = run(program, (bucket, *batch.bucket), *context_kv, np.int32(shared), *arrays)
                return self._read(run, *outputs, batch, rows, jobs)
            out.append(self.launcher.launch(forward_and_heads, after=context_kv))
            self.prefix_batches += 1
            self.count(len(batch.members))
        return out

    def count(self, rows: int) -> None:
        """A device batch of `rows` rows run (for /metrics: mean rows per device batch)."""
        self.device_batches += 1
        self.device_rows += rows

    def _read(self, run: Run, hidden, tails, batch: DeviceBatch, rows: list[Row], jobs: Sequence[Job]) -> Entries:
        """The heads on a device batch's pooled rows: label log-probabilities, a classification model's logits, or
        a classification adapter's own; or, for rows of labels of several tokens, the targets' log-probabilities
        the forward pass read (`tails`). Each output with the rows it answers (None: a slot another answers)."""
        members = [rows[i] for i in batch.members]
        if self.task != "causal_lm":
            return [(run("class_logits", (batch.head_batch,), hidden), members)]
        out = []
        labelled = [row if row.targets is not None else None for row in members]
        if any(labelled):
            out.append((tails, labelled))
            members = [None if row.targets is not None else row for row in members]
            if not any(members):
                return out
        own = [row if row is not None and jobs[row.job].head else None for row in members]
        if any(own):
            slots = np.zeros((batch.head_batch,), np.int32)
            for r, row in enumerate(members):
                slots[r] = jobs[row.job].adapter if row is not None else 0
            out.append((run("lora_class_logits", (batch.head_batch,), hidden, slots), own))
        vocabulary = [None if row is None or jobs[row.job].head else row for row in members]
        if any(vocabulary):
            # A request's label count is checked once, against SCOREFN_MAX_LABELS (handler.score's too_many_labels):
            # the largest label bucket. No request gets past it; fit's ValueError is for callers of the scorer
            # itself (tests, the benchmark, `scorefn score`) that ask for more labels than any compiled head reads.
            n_labels = fit(self.plan.labels, max(len(jobs[row.job].label_ids) for row in vocabulary if row))
            labels = np.zeros((batch.head_batch, n_labels), np.int32)  # padding rows and columns gather label 0
            for r, row in enumerate(vocabulary):
                ids = jobs[row.job].label_ids if row is not None else ()
                labels[r, : len(ids)] = ids
            out.append((run("label_logprobs", (batch.head_batch, n_labels), hidden, labels), vocabulary))
        return out

    def _dispatch_tokens(self, rows: list[Row], jobs: Sequence[Job | TokenJob], cached_tokens: list[int]
                         ) -> list[Launched]:
        return prompt_rows.dispatch(self, rows, jobs, cached_tokens)


def context_program(plan: BucketPlan, tokens: Sequence[int], shared: int, hit: Hit | None) -> tuple[tuple, int]:
    """How a context of tokens[:shared] is computed: (program, bucket, its arguments before the adapter) and the
    context bucket its keys and values fill. extend_context past a `hit` the prefix cache holds of it (the tokens
    after it, in the hit's context bucket), else prefill_context on all of them."""
    if hit is not None:
        bucket, length = hit.context, fit(plan.rest_lengths(), shared - hit.length)
        rest = np.zeros((1, length), np.int32)
        rest[0, : shared - hit.length] = tokens[hit.length:shared]
        return ("extend_context", (bucket, length), (*hit.kv, np.int32(hit.length), rest)), bucket
    bucket = fit(plan.contexts(), shared)
    prefix = np.zeros((1, bucket), np.int32)
    prefix[0, :shared] = tokens[:shared]
    return ("prefill_context", (bucket,), (prefix,)), bucket
