"""What the engine is asked to compute (a request's sequences and what to read from them), and how a request's
sequences are split into a shared prefix and the items after it. Pure Python and NumPy: admission, the cost model
and the scorer share it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from runtime.interface import Sampling
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


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Every sequence lies between the lexicographically smallest and largest one, so they share what those two
    share (min and max compare in C: 13x faster than comparing each sequence, and admission pays it too)."""
    lowest, highest = min(sequences, key=list), max(sequences, key=list)
    length = min(len(lowest), len(highest))
    for n in range(length):
        if lowest[n] != highest[n]:
            return n
    return length


def shareable_prefix(job: Job) -> int:
    """The most leading tokens of a request's rows one shared context may compute: their common prefix, short of
    the first position any row reads (its last, or the first of its label's tail), which must lie in the row's own
    suffix: the context's positions give keys and values, not outputs."""
    if len(job.sequences) < 2:
        return 0
    reads = job.targets or [()] * len(job.sequences)
    first_read = min(len(seq) - max(len(read), 1) for seq, read in zip(job.sequences, reads))
    return max(min(common_prefix_length(job.sequences), first_read), 0)


def shared_prefix_length(plan: BucketPlan, job: Job, rope_length_limit: int | None) -> int:
    """Tokens of a request's shareable prefix to compute once, or 0 when scoring its rows in full costs less: fewer
    padded tokens plus the plan's price of a device batch for each. Longer sequences than `rope_length_limit` change
    their RoPE frequencies (dynamic, longrope), so the context's keys would differ from each item's own: such
    requests are scored in full."""
    sequences = job.sequences
    if not plan.prefix_sharing or len(sequences) < 2:
        return 0
    if rope_length_limit is not None and max(map(len, sequences)) > rope_length_limit:
        return 0
    shared = shareable_prefix(job)
    rests = sorted((len(s) - shared for s in sequences), reverse=True)
    contexts = plan.contexts()
    if shared == 0 or rests[0] > plan.max_suffix or not contexts or shared > contexts[-1]:
        return 0
    overhead = plan.batch_overhead_tokens
    shared_cost = fit(contexts, shared) + overhead + sum(b.padded_tokens + overhead for b in plan.split_suffixes(rests))
    full_cost = sum(b.padded_tokens + overhead for b in plan.split_full([len(s) for s in sequences]))
    return shared if shared_cost < full_cost else 0
