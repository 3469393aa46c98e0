"""The readouts: what the scoring programs compute from the trunk's final hidden states (runtime.model.transformer
runs the layers): labels' log-probabilities over the vocabulary, every position's next-token distribution with its
top-k and the chosen next token, and the sequence-classification heads.

Functions of the weights they read and of hidden states, nothing of the layers: the trunk's entry points call them
with its final norm (`normed`) and its way over rows (`rows`: in fixed tiles of rows for the batch-invariant kernels,
else at once). Shapes as in runtime.model.transformer: B batch, T positions, D hidden, V vocabulary, L labels.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from runtime.model import invariant

F32 = jnp.float32
TOP_K = 20  # runtime.interface.MAX_TOP_LOGPROBS: alternatives computed per position
HEAD_CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk of positions in token_logprobs
TOP_K_GROUP = 16  # vocabulary entries per group of _top_k's first pass

Rows = Callable[[Callable, object], jax.Array]  # fn over rows of xs [B, ...]
Normed = Callable[[jax.Array], jax.Array]  # the trunk's final norm


@dataclasses.dataclass(frozen=True)
class VocabHead:
    """The vocabulary projection and what a family does to its logits."""
    weight: jax.Array  # [V, D]: the embedding when the model ties them
    divisor: float  # Granite divides the logits
    softcap: float | None  # Gemma 2/3 soft-cap them
    invariant_rows: tuple[int, int] | None  # the batch-invariant kernels' head rows (Kernels.head_rows), or None
    # What token_logprobs multiplies at every position (None: `weight`): the weight transposed [D, V] in the model's
    # format, accumulated in float32, as transformers reads it (bfloat16: 0.3 s less of a 2.5 s batch of 8 x 256
    # positions, its error against transformers float32 still a third of transformers bfloat16's: AMD EPYC Zen 4,
    # 2026-11-28). [D, V]: XLA:CPU laid a bfloat16 [V, D] out as [D, V] with a copy on every call (~15 ms). Labels'
    # log-probabilities read `weight`, float32.
    positions_weight: jax.Array | None = None

    def final(self, logits: jax.Array) -> jax.Array:
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = jnp.tanh(logits / self.softcap) * self.softcap
        return logits


def label_logprobs(head: VocabHead, hidden: jax.Array, labels: jax.Array) -> jax.Array:
    """hidden [B, D], labels [B, L] (per row) -> log P(label) over the full vocabulary [B, L] float32."""
    if head.invariant_rows is None:
        return _label_logprobs(head, hidden, labels)
    tile = invariant.head_tile(hidden.shape[0], head.invariant_rows)
    return invariant.rowwise(lambda xs: _invariant_label_logprobs(head, *xs), (hidden, labels), tile)


def _invariant_label_logprobs(head: VocabHead, hidden: jax.Array, labels: jax.Array) -> jax.Array:
    """A tile of rows, each with the bits it has in any other tile of head_rows: the logits are the columns of
    weight @ hidden.T [V, tile], which keep them (bitclasses.measure's columns), and stay columns (the vocabulary as
    the matmul's rows: XLA:CPU took 4.8 ms for 2 hidden states where hidden @ weight.T took 7.1, and the transposed
    logits as much: AMD EPYC Zen 4, 2026-11-28); the labels' logits are read off them and their log-sum-exp sums by
    halves."""
    logits = head.final(invariant.matmul(head.weight, hidden, ((1,), (1,))))  # [V, tile]
    return jnp.take_along_axis(logits, labels.T, axis=0).T - invariant.logsumexp_columns(logits)[:, None]


def _label_logprobs(head: VocabHead, hidden: jax.Array, labels: jax.Array) -> jax.Array:
    logits = head.final(jnp.einsum("bd,vd->bv", hidden, head.weight, preferred_element_type=F32))
    # The labels' logits as an elementwise product and sum rather than read off the matmul: XLA picks
    # matmul kernels by batch size, and this keeps a row's score the same in any batch (~1e-5 better).
    label_logits = head.final(jnp.sum(hidden[:, None, :] * jnp.take(head.weight, labels, axis=0), axis=-1))
    return label_logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)


def token_logprobs(head: VocabHead, h: jax.Array, pooled: jax.Array, tokens: jax.Array, lengths: jax.Array,
                   temperature: jax.Array, seed: jax.Array, normed: Normed, rows: Rows):
    """Every position's next-token distribution from the trunk's hidden states h [B, T, D] (before the final
    norm; `pooled` [B, D]: each row's last position, normed, as the trunk pools it), read without materializing
    [B, T, V] logits at once; the outputs of Transformer.token_logprobs.
    The vocabulary projection (head.positions_weight, else head.weight; accumulated in float32) runs over chunks of
    positions (a scan), each at most HEAD_CHUNK_BYTES of float32 logits (batch-invariant kernels: fixed tiles of
    positions); a chosen token's log-probability and its top-k entry are the same float."""
    B, T = tokens.shape
    if head.positions_weight is None:
        project = lambda h_c: jnp.einsum("bcd,vd->bcv", h_c, head.weight, preferred_element_type=F32)
    else:
        weight = head.positions_weight  # [D, V]
        project = lambda h_c: jnp.einsum("bcd,dv->bcv", h_c.astype(weight.dtype), weight, preferred_element_type=F32)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)  # next token [B, T]

    def read(xs):
        h_c, t_c = xs  # [B, c, D], [B, c]
        logits = head.final(project(h_c))
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0] - lse
        top_values, top_ids = _top_k(logits, TOP_K)
        return chosen, top_ids.astype(jnp.int32), top_values - lse[..., None]

    if head.invariant_rows is not None:  # every position in fixed tiles of positions, whatever the batch
        def read_tile(xs):
            h_t, t_t = xs  # [tile, D], [tile]
            return tuple(a[0] for a in read((normed(h_t)[None], t_t[None])))
        flat = invariant.rowwise(read_tile, (h.reshape(B * T, -1), targets.reshape(B * T)), invariant.POSITION_TILE)
        next_logprobs, top_ids, top_logprobs = (a.reshape(B, T, *a.shape[1:]) for a in flat)
    else:
        chunk = _positions_per_chunk(B, T, head.weight.shape[0])

        def chunked(x):  # [B, T, ...] -> [T / c, B, c, ...]
            return jnp.moveaxis(x.reshape(B, T // chunk, chunk, *x.shape[2:]), 1, 0)

        def unchunked(x):  # [T / c, B, c, ...] -> [B, T, ...]
            return jnp.moveaxis(x, 0, 1).reshape(B, T, *x.shape[3:])
        next_logprobs, top_ids, top_logprobs = map(unchunked, jax.lax.map(read, (chunked(normed(h)),
                                                                                 chunked(targets))))
    last = lengths - 1
    greedy = jnp.take_along_axis(top_ids, last[:, None, None], axis=1)[:, 0, 0]
    greedy_logprob = jnp.take_along_axis(top_logprobs, last[:, None, None], axis=1)[:, 0, 0]
    # Drawn at a temperature: from the last position's whole distribution (float32), with the row's own generator.
    last_logprobs = rows(lambda x: jax.nn.log_softmax(
        head.final(jnp.einsum("bd,vd->bv", x, head.weight, preferred_element_type=F32))), pooled)
    drawn = jax.vmap(lambda s, lp, t: jax.random.categorical(jax.random.key(s), lp / t))(
        seed, last_logprobs, jnp.maximum(temperature, 1e-6))
    sample = temperature > 0
    next_id = jnp.where(sample, drawn, greedy).astype(jnp.int32)
    next_logprob = jnp.where(sample, jnp.take_along_axis(last_logprobs, drawn[:, None], axis=1)[:, 0],
                             greedy_logprob)
    return next_logprobs, top_ids, top_logprobs, next_id, next_logprob


def class_logits(score_head: jax.Array, hidden: jax.Array, rows: Rows) -> jax.Array:
    """Sequence-classification head [num_labels, D]: hidden [B, D] -> raw logits [B, num_labels] float32."""
    return rows(lambda x: jnp.einsum("bd,nd->bn", x.astype(score_head.dtype), score_head,
                                     preferred_element_type=F32), hidden)


def lora_class_logits(lora_heads: jax.Array, hidden: jax.Array, adapters: jax.Array, rows: Rows) -> jax.Array:
    """Classification adapters' own heads [adapters, MAX_HEAD_LABELS, D] (runtime.model.lora): hidden [B, D] and
    each row's adapter [B] -> raw logits [B, MAX_HEAD_LABELS] float32 (past an adapter's labels: 0)."""
    def per_row(xs):
        h, slot = xs
        heads = jnp.take(lora_heads, jnp.maximum(slot - 1, 0), axis=0)  # [B, labels, D]
        return jnp.einsum("bd,bld->bl", h, heads, preferred_element_type=F32)
    return rows(per_row, (hidden, adapters))


def _positions_per_chunk(batch: int, length: int, vocab: int) -> int:
    """The largest power of two dividing `length` whose [batch, chunk, vocab] float32 logits fit the budget."""
    chunk = 1
    while length % (chunk * 2) == 0 and batch * chunk * 2 * vocab * 4 <= HEAD_CHUNK_BYTES:
        chunk *= 2
    return chunk


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis, exactly, at the cost of a max: the k largest entries lie in the k groups
    of TOP_K_GROUP entries with the largest maxima (a group holding one of them has a maximum at least as large,
    and at most k - 1 other groups can beat it), so one top_k runs over the groups' maxima and one over those
    groups' entries, in vocabulary order so that ties still go to the lowest id. lax.top_k over a 152k vocabulary
    was 20x the vocabulary matmul on an H100 and a quarter of it on a CPU; this is a few percent."""
    *lead, v = x.shape
    if v < 4 * k * TOP_K_GROUP:  # too few groups to gain
        return jax.lax.top_k(x, k)
    grouped = jnp.pad(x, [(0, 0)] * len(lead) + [(0, (-v) % TOP_K_GROUP)], constant_values=-jnp.inf)
    grouped = grouped.reshape(*lead, -1, TOP_K_GROUP)  # [..., G, TOP_K_GROUP]
    _, groups = jax.lax.top_k(grouped.max(axis=-1), k)
    groups = jnp.sort(groups, axis=-1)  # [..., k]
    candidates = jnp.take_along_axis(grouped, groups[..., None], axis=-2).reshape(*lead, k * TOP_K_GROUP)
    ids = (groups[..., None] * TOP_K_GROUP + jnp.arange(TOP_K_GROUP)).reshape(*lead, k * TOP_K_GROUP)
    values, picked = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(ids, picked, axis=-1)
