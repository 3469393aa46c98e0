"""What the engine is asked to compute (a request's sequences and what to read from them), and how a request's
sequences are split into a shared prefix and the items after it. Pure Python and NumPy: admission, the cost model
and the scorer share it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from runtime.interface import Sampling
from runtime.requests.prefix_cache import MIN_TOKENS
from runtime.shapes.buckets import BucketPlan, fit


@dataclasses.dataclass(frozen=True)
class Job:
    """Score label tokens after each sequence: [n_sequences, n_labels] log-probabilities. Or, with `targets` (see
    label_rows), each sequence's label of several tokens: [n_sequences, tail] log-probabilities of the tokens its
    last positions predict, right-aligned."""
    sequences: Sequence[Sequence[int]]
    # What each sequence's last position is read at: the vocabulary head's label token IDs; with `head`, the columns
    # 0 .. n-1 of the adapter's own head; with `targets` (label_rows), the labels, each a tuple of token IDs.
    label_ids: Sequence[int]
    adapter: int = 0  # the LoRA adapter scoring them (runtime.model.lora: 1..S), 0 the base model
    # The adapter's own classification head instead of the vocabulary head: raw logits of its labels 0 .. n-1
    head: bool = False
    targets: Sequence[Sequence[int]] | None = None  # per sequence: the label tokens its last positions predict
    cache_salt: str | None = None  # prefixes are shared through the prefix cache only with the same salt


def label_rows(sequences: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], adapter: int = 0) -> Job:
    """Labels of any number of tokens after each sequence, as rows: for sequence i and label j (row i * L + j), the
    sequence and all but the label's last token, its last positions predicting the label's tokens. The rows of an
    item share its sequence (and those of a request the query), which the cascade computes once."""
    rows = [list(seq) + list(label[:-1]) for seq in sequences for label in labels]
    return Job(rows, tuple(map(tuple, labels)), adapter, targets=[tuple(label) for _ in sequences for label in labels])


def label_scores(tails: np.ndarray, labels: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """label_rows' results [items * L, tail] -> (each label's log-probability, the sum of its tokens' in float64
    [items, L] float32; each label's tokens' log-probabilities [items][L])."""
    per_token = [[tails[i * len(labels) + j, tails.shape[1] - len(label):] for j, label in enumerate(labels)]
                 for i in range(len(tails) // max(len(labels), 1))]
    sums = np.array([[float(np.sum(tokens, dtype=np.float64)) for tokens in row] for row in per_token], np.float32)
    return sums.reshape(len(per_token), len(labels)), per_token


@dataclasses.dataclass(frozen=True)
class TokenJob:
    """Every position's next-token log-probabilities and top tokens, and one chosen token after each sequence."""
    sequences: Sequence[Sequence[int]]
    sampling: Sequence[Sampling]  # one per sequence
    adapter: int = 0  # the LoRA adapter scoring them (runtime.model.lora: 1..S), 0 the base model
    cache_salt: str | None = None  # prompts are shared through the prefix cache only with the same salt


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Every sequence lies between the lexicographically smallest and largest one, so they share what those two
    share (min and max compare in C: 13x faster than comparing each sequence, and admission pays it too)."""
    lowest, highest = min(sequences, key=list), max(sequences, key=list)
    length = min(len(lowest), len(highest))
    for n in range(length):
        if lowest[n] != highest[n]:
            return n
    return length


def first_read(job: Job) -> int:
    """The first position any of a job's rows reads (its last, or the first of its label's tail): what comes before
    it may be a shared context, whose positions give keys and values, not outputs."""
    reads = job.targets or [()] * len(job.sequences)
    return max(min(len(seq) - max(len(read), 1) for seq, read in zip(job.sequences, reads)), 0)


def shareable_prefix(job: Job) -> int:
    """The most leading tokens of a request's rows one shared context may compute: their common prefix, short of
    the first position any row reads."""
    if len(job.sequences) < 2:
        return 0
    return min(common_prefix_length(job.sequences), first_read(job))


def _cascade_cost(plan: BucketPlan, job: Job, shared: int) -> int:
    """Padded tokens plus the plan's price of each device batch, of a job's rows after `shared` tokens (the context
    itself not counted)."""
    rests = sorted((len(s) - shared for s in job.sequences), reverse=True)
    return sum(b.padded_tokens + plan.batch_overhead_tokens for b in plan.split_suffixes(rests))


def _full_cost(plan: BucketPlan, job: Job) -> int:
    return sum(b.padded_tokens + plan.batch_overhead_tokens for b in plan.split_full([len(s) for s in job.sequences]))


def _can_cascade(plan: BucketPlan, job: Job, shared: int, rope_length_limit: int | None) -> bool:
    """Whether a context of `shared` tokens fits a context bucket and every row's rest an item bucket. Longer sequences
    than `rope_length_limit` change their RoPE frequencies (dynamic, longrope), so a context's keys would differ from
    each row's own: such requests are scored in full."""
    contexts = plan.contexts()
    return bool(shared > 0 and contexts and shared <= contexts[-1]
                and max(len(s) for s in job.sequences) - shared <= plan.max_suffix
                and (rope_length_limit is None or max(map(len, job.sequences)) <= rope_length_limit))


def shared_prefix_length(plan: BucketPlan, job: Job, rope_length_limit: int | None) -> int:
    """Tokens of a request's shareable prefix to compute once, or 0 when scoring its rows in full costs less: fewer
    padded tokens plus the plan's price of a device batch for each."""
    if not plan.prefix_sharing or len(job.sequences) < 2:
        return 0
    shared = shareable_prefix(job)
    if not _can_cascade(plan, job, shared, rope_length_limit):
        return 0
    shared_cost = fit(plan.contexts(), shared) + plan.batch_overhead_tokens + _cascade_cost(plan, job, shared)
    return shared if shared_cost < _full_cost(plan, job) else 0


@dataclasses.dataclass(frozen=True)
class Context:
    """How a job's rows are scored: after a context of `length` leading tokens (0: in full), taken from the prefix
    cache (`cached`) or computed (and then kept when `keep`): whole, or past its first `extends` tokens, which the
    cache holds (extend_context)."""
    length: int = 0
    cached: bool = False
    keep: bool = False
    extends: int = 0


def context_key(job: Job, context: Context) -> tuple:
    """What rows scored after a context share: requests whose keys are equal read one context (computed once, or one
    cache entry) in common device batches (the bits are a row's own: attention walks keys in fixed blocks)."""
    return job.adapter, job.cache_salt, tuple(job.sequences[0][: context.length])


def plan_context(plan: BucketPlan, job: Job | TokenJob, rope_length_limit: int | None,
                 cached: Callable[[Job, int], int] | None = None) -> Context:
    """The cheapest way to score a job's rows (padded tokens plus a device batch's price): in full, after its shared
    prefix computed once, or, with a prefix cache (`cached(job, limit)`: how many of its first `limit` tokens it
    holds), after its cached leading tokens, or after its shared prefix computed past them (and kept). A job scored in
    full whose leading MIN_TOKENS or more (up to its first read) could be cached computes them apart instead, so that
    the next request finds them."""
    if isinstance(job, TokenJob):
        return Context()
    shared = shared_prefix_length(plan, job, rope_length_limit)
    if cached is None or not plan.prefix_sharing:
        return Context(shared, keep=False)
    limit = shareable_prefix(job) if len(job.sequences) > 1 else first_read(job)
    hit = cached(job, limit)
    options = []  # the cheapest first, a hit first among equals (it computes no more)
    if hit and _can_cascade(plan, job, hit, rope_length_limit):
        options.append((_cascade_cost(plan, job, hit), Context(hit, cached=True)))
    share = limit if len(job.sequences) > 1 else 0
    if hit and _can_extend(plan, hit, share) and _can_cascade(plan, job, share, rope_length_limit):
        options.append((fit(plan.rest_lengths(), share - hit) + plan.batch_overhead_tokens
                        + _cascade_cost(plan, job, share), Context(share, keep=True, extends=hit)))
    options.append((_full_cost(plan, job), Context()))
    if shared:
        options.append((fit(plan.contexts(), shared) + plan.batch_overhead_tokens + _cascade_cost(plan, job, shared),
                        Context(shared, keep=True)))
    best = min(options, key=lambda option: option[0])[1]
    # All it can (up to its first read, within the largest context): a later prompt that shares part of its last
    # block finds that part too (runtime.requests.prefix_cache).
    kept = min(limit, plan.contexts()[-1]) if plan.contexts() else 0
    if best.length == 0 and kept >= MIN_TOKENS and _can_cascade(plan, job, kept, rope_length_limit):
        return Context(kept, keep=True)
    return best


def _can_extend(plan: BucketPlan, hit: int, length: int) -> bool:
    """Whether a cached context of `hit` tokens can be extended to `length` in one extend_context bucket: it is one the
    cache keeps extensions of (plan.kept_contexts), the tokens after it fit a rest length, and the longer prefix its
    context bucket (the entry's is at least the one that fits `hit`)."""
    return bool(plan.extensions() and plan.kept_prompts <= hit < length <= fit(plan.contexts(), hit)
                and length - hit <= plan.rest_lengths()[-1])


def plan_completion(plan: BucketPlan, job: TokenJob, tokens: Sequence[int], rope_length_limit: int | None,
                    cached: Callable[[TokenJob, Sequence[int]], int] | None) -> Context:
    """How one prompt read at every position is computed, with a prefix cache (`cached(job, tokens)`: how many of its
    leading tokens a prompt kept with its per-position outputs holds): after its cached part (`length` the tokens
    held; the last of them is computed again, as the first position of the rest, for the log-probability of the token
    after it), when the rest fits the buckets for it and pads fewer tokens than the whole; else whole, and kept
    (`keep`) when it is plan.kept_prompts or longer and fits a context bucket, so that the next prompt that shares its
    leading tokens finds them; else whole."""
    contexts = plan.kept_prompt_contexts()
    if cached is None or not contexts or (rope_length_limit is not None and len(tokens) > rope_length_limit):
        return Context()
    held = cached(job, tokens)
    rest = len(tokens) - held + 1
    if held >= 2 and rest <= plan.rest_lengths()[-1] and \
            fit(plan.rest_lengths(), rest) < fit(plan.lengths, len(tokens)):
        return Context(held, cached=True)
    if plan.kept_prompts <= len(tokens) <= contexts[-1]:
        return Context(len(tokens), keep=True)
    return Context()


def plan_prompts(plan: BucketPlan, prompts: Sequence[tuple[TokenJob, Sequence[int]]], rope_length_limit: int | None,
                 cached: Callable[[TokenJob, Sequence[int]], int] | None) -> list[tuple[Context, int | None]]:
    """plan_completion for a round's prompts, in order, each with the index of an earlier prompt of the round that it
    reads after (or None): a prompt the cache does not serve, whose leading tokens a prompt kept earlier in the round
    shares (lm-evaluation-harness's answers to one question in one request), reads its rest after that one's keys and
    values, as after a cached one."""
    out: list[tuple[Context, int | None]] = []
    kept: list[int] = []
    for job, tokens in prompts:
        prompt, leader = plan_completion(plan, job, tokens, rope_length_limit, cached), None
        owners = [k for k in kept if (prompts[k][0].adapter, prompts[k][0].cache_salt) == (job.adapter, job.cache_salt)]
        if not prompt.cached and owners:  # (a prompt is kept only where there is a cache)
            shared, first = max((common_prefix_length([tokens, prompts[k][1]]), k) for k in owners)
            after = plan_completion(plan, job, tokens, rope_length_limit, lambda *_: shared)
            if after.cached:
                prompt, leader = after, first
        if prompt.keep:
            kept.append(len(out))
        out.append((prompt, leader))
    return out
