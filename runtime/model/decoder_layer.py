"""One decoder layer, every family's (DecoderLayer: the body the trunk's loop runs once per layer,
runtime.model.transformer), and what every layer of a forward pass shares, computed once by the trunk: the RoPE
tables (rotary_tables) and each token's mask of the stacked LoRA columns (lora_mask).

The families' variants are data of the config (runtime.model.config.ModelConfig) that the layer reads, not code paths
per family: norms before the attention and MLP (most) and of their outputs (Gemma 2/3, OLMo 2), q/k norms per head
(Qwen3, Gemma 3) or over all heads (OLMo 2), Gemma 3's local RoPE on its sliding layers, attention soft-caps,
sinks (gpt-oss) and windows, Granite's residual scale, routed experts in place of the gated MLP, and each projection's
LoRA update (runtime.model.lora). The pure parts (projections, norms, rotation, MLP, experts) are in
runtime.model.layers; the batch-invariant kernels in runtime.model.invariant.

Shapes: B batch, T query tokens, M tokens of the batch-invariant stream, C context (shared-prefix) tokens, D hidden,
N heads, K KV heads, E head dim, R rotary dims, S * R stacked LoRA columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from runtime.model import attention, invariant
from runtime.model.config import ModelConfig
from runtime.model.kernels import Kernels
from runtime.model import experts
from runtime.model.layers import dense, gated_mlp, project, rms_norm, rope_tables, rotate

F32 = jnp.float32


def _first(tree):
    """The arrays of a batch-invariant stream's pytree ([1, M, ...] each; None as it is) without their leading 1."""
    return jax.tree.map(lambda a: a[0], tree)


@dataclasses.dataclass(frozen=True)
class DecoderLayer:
    """The layer body of one model: its config, kernels, sliding window (None: no window masks anything) and
    attention dtype. A call takes one layer's weights `p` (its slice of the stacked weights, with what differs
    between layers: Transformer._layer_data)."""
    cfg: ModelConfig
    kernels: Kernels
    window: int | None
    attention_dtype: Any  # a jnp.dtype

    def __call__(self, h, p, rope, ctx=None, rows=None, lora=None):
        """h [B, T, D] float32 -> (h, (k, v)); with a context (ctx_k, ctx_v [C, K, E], ctx_len, positions [B, T]),
        the queries also attend the context's first ctx_len keys; with an attention.Packed, each row holds several
        sequences (see _attend). `rope`: (cos, sin) [B, T, R], and the local (cos, sin) or None.
        `rows`: (B, T) when h is the batch-invariant stream of their tokens [1, M, D] (invariant.flatten): all but
        attention run on the stream (`rope` too), attention on the rows. `lora`: each token's mask of the stacked
        LoRA columns (lora_mask), or None."""
        stream = rows is not None
        chunk = self.kernels.stream_chunk if stream else 0
        if chunk:  # the stream in fixed chunks of tokens: every matmul and norm of one compiled shape, one kernel
            def tokens_in(xs):
                h_c, rope_c, lora_c = xs
                q, k, v = self._project(h_c[None], p, False, None if lora_c is None else lora_c[None])
                q, k = self._heads(q, k, p, jax.tree.map(lambda t: t[None], rope_c), False)
                return q[0], k[0], v[0]
            q, k, v = (a[None] for a in invariant.rowwise(tokens_in, (h[0], _first(rope), _first(lora)), chunk))
        else:
            q, k, v = self._project(h, p, stream, lora)
            q, k = self._heads(q, k, p, rope, stream)
        if stream:
            q, k, v = (invariant.unflatten(a, rows) for a in (q, k, v))
        out = self._attend(q, k, v, p, ctx, stream)
        if stream:
            out = invariant.flatten(out, h.shape[1])
        if chunk:
            def tokens_out(xs):
                h_c, out_c, lora_c = xs
                return self._finish(h_c[None], out_c[None], p, False, None if lora_c is None else lora_c[None])[0]
            return invariant.rowwise(tokens_out, (h[0], out[0], _first(lora)), chunk)[None], (k, v)
        return self._finish(h, out, p, stream, lora), (k, v)

    def _project(self, h, p, stream: bool, lora=None):
        """The attention's projections: h [B, T, D] -> q [B, T, N * E], k [B, T, K * E] float32 (to be normed and
        rotated by _heads), v [B, T, K, E] in the attention dtype. `stream`: h is the batch-invariant stream."""
        cfg = self.cfg
        B, T, _ = h.shape
        x = self._norm(h, p["attn_norm"], stream) if cfg.pre_norms else h
        q, k = self._dense(x, p, "wq", lora), self._dense(x, p, "wk", lora)
        v = self._dense(x, p, "wv", lora).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v.astype(self.attention_dtype)

    def _heads(self, q, k, p, rope, stream: bool):
        """q [B, T, N * E] and k [B, T, K * E] -> normed (where the family norms them) and rotated q [B, T, N, E],
        k [B, T, K, E] in the attention dtype. `stream`: q and k are the batch-invariant stream. It rotates with
        exact products (layers.rotate), whose bits no shape or fusion moves, over all its tokens at once; q/k norms
        (a reduction whose order followed the number of tokens) run in fixed tiles of tokens first
        (runtime.model.invariant)."""
        (cos, sin), local = rope
        if local is not None:  # Gemma 3: the sliding layers' own RoPE base
            cos, sin = jnp.where(p["local_rope"], local[0], cos), jnp.where(p["local_rope"], local[1], sin)
        if stream and self.cfg.qk_norm:  # float32 out of the loop (a bfloat16 one was updated through float32)
            q, k = invariant.tokenwise(lambda xs: tuple(a[0] for a in self._qk_normed(*(x[None] for x in xs), p)),
                                       (q, k))
        elif self.cfg.qk_norm:
            q, k = self._qk_normed(q, k, p)
        B, T, _ = q.shape
        q = rotate(q.reshape(B, T, self.cfg.num_heads, self.cfg.head_dim), cos, sin, exact_products=stream)
        k = rotate(k.reshape(B, T, self.cfg.num_kv_heads, self.cfg.head_dim), cos, sin, exact_products=stream)
        return q.astype(self.attention_dtype), k.astype(self.attention_dtype)

    def _qk_normed(self, q, k, p):
        """q [..., N * E] and k [..., K * E] normed as the family norms them: OLMo 2 over all heads at once (its
        "projection" norm), Qwen3 and Gemma 3 per head."""
        cfg = self.cfg
        if cfg.qk_norm == "projection":
            return rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q_heads = q.reshape(*q.shape[:-1], cfg.num_heads, cfg.head_dim)
        k_heads = k.reshape(*k.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        return (rms_norm(q_heads, p["q_norm"], cfg.rms_norm_eps).reshape(q.shape),
                rms_norm(k_heads, p["k_norm"], cfg.rms_norm_eps).reshape(k.shape))

    def _finish(self, h, out, p, stream: bool, lora=None):
        """After attention: out [B, T, N, E] projected and added to h [B, T, D], then the MLP (or experts).
        `stream`: h is the batch-invariant stream (its router in fixed tiles of tokens)."""
        cfg = self.cfg
        B, T, _ = h.shape
        out = self._dense(out.reshape(B, T, cfg.num_heads * cfg.head_dim), p, "wo", lora)
        h = self._residual(h, out, p.get("attn_post_norm"), stream)
        x = self._norm(h, p["mlp_norm"], stream) if cfg.pre_norms else h
        if cfg.num_experts:
            y = self._experts(x, p, stream)
        else:
            y = gated_mlp(x, p, cfg.activation, lambda x, name: self._dense(x, p, name, lora))
        return self._residual(h, y, p.get("mlp_post_norm"), stream)

    def _experts(self, x, p, stream: bool):
        """The routed experts on x [B, T, D] (or the stream [1, M, D]) -> float32 of its shape. The stream's router
        runs in fixed tiles of tokens; its experts always in the routed layout's tiles (Kernels.expert_tile: the bits
        hold), unless SCOREFN_EXPERTS says all. Elsewhere the routed layout where it computes fewer rows than every
        expert on every token (Kernels.experts: auto)."""
        cfg = self.cfg
        tokens = x.reshape(-1, x.shape[-1])
        route = lambda t: experts.router_top_k(t, p["router"], cfg.experts_per_token, cfg.norm_topk_prob,
                                               p.get("router_bias"), cfg.router_top_k_first)
        weights, chosen = invariant.tokenwise(route, tokens[None]) if stream else route(tokens)
        if stream:
            weights, chosen = weights[0], chosen[0]
        tile = self.kernels.expert_tile
        N, X, k = tokens.shape[0], cfg.num_experts, cfg.experts_per_token
        choice = self.kernels.experts
        glu = experts.gated(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        if choice == "routed" or choice == "auto" and (stream or experts.routed_rows(N, X, k, tile) < N * X):
            y = experts.mixture(tokens, weights, chosen, p, glu, tile)
        else:
            y = experts.all_experts(tokens, weights, chosen, p, glu)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def _dense(x, p, name: str, lora):
        """x @ p[name] (+ its bias: bq for wq, b_gate for w_gate), plus each token's LoRA update where the model
        has adapters: ((x @ A_all) * mask) @ B_all over every adapter's columns at once (runtime.model.lora); the
        columns of other adapters add exact zeros, so a token's result does not depend on its neighbours'."""
        y = project(x, p, name)
        if lora is None or f"lora_a_{name}" not in p:
            return y
        return y + dense(dense(x, p[f"lora_a_{name}"]) * lora, p[f"lora_b_{name}"])

    def _norm(self, x, weight, stream: bool):
        """RMSNorm of x [..., D]; on the batch-invariant stream with its sums of squares as a matmul (as a reduction
        a token's bits moved with the number of tokens: runtime.model.invariant)."""
        return (invariant.rms_norm if stream else rms_norm)(x, weight, self.cfg.rms_norm_eps)

    def _attend(self, q, k, v, p, ctx, stream: bool):
        """Attention of one layer: causal over whole rows (ctx None), after a shared context (ctx: context keys,
        values, length, positions), or within the sequences packed into rows (an attention.Packed). The window is
        the layer's own where layers differ (a traced scalar), else the model's (a Python int or None). `stream`:
        the rows come from the batch-invariant stream, and attend with its kernels (runtime.model.invariant)."""
        cfg = self.cfg
        window = p.get("window", self.window)
        sinks = p.get("sinks")  # gpt-oss
        how = dict(implementation=self.kernels.attention, scale=cfg.attention_scale, softcap=cfg.attention_softcap,
                   sinks=sinks)
        if stream:
            context = None if ctx is None else ctx[:3]
            if sinks is not None and self.kernels.attention.startswith("pallas"):
                raise ValueError("the Pallas attention kernels cannot take attention sinks (attention_fit runs XLA's)")
            if self.kernels.attention == "pallas":
                from runtime.model import pallas_attention
                return pallas_attention.causal(q, k, v, window, cfg.attention_scale, cfg.attention_softcap, context)
            if self.kernels.attention == "pallas_tpu":
                from runtime.model import pallas_tpu_attention
                return pallas_tpu_attention.causal(q, k, v, window, cfg.attention_scale, cfg.attention_softcap,
                                                   context)
            return invariant.causal(q, k, v, window, cfg.attention_scale, cfg.attention_softcap, context,
                                    self.kernels.min_rows, sinks)
        if ctx is None:
            return attention.causal(q, k, v, window, **how)
        if isinstance(ctx, attention.Packed):
            return attention.packed(q, k, v, ctx, window, **how)
        return attention.after_context(q, k, v, *ctx, window, **how)

    def _residual(self, h, branch, post_norm, stream: bool):
        """h + the branch, normed first where the family norms outputs (Gemma 2/3, OLMo 2), scaled (Granite)."""
        if post_norm is not None:
            branch = self._norm(branch, post_norm, stream)
        if self.cfg.residual_scale != 1.0:
            branch = branch * self.cfg.residual_scale
        return h + branch


def lora_mask(columns, adapters, shape: tuple[int, int], stream: int | None):
    """Each token's mask [B, T, S * R] (or [1, M, S * R] on the batch-invariant stream) of the LoRA columns of
    its adapter: `columns` says which adapter (1..S) each stacked column belongs to (None: the model has no
    adapters); `adapters` per row [B] or per token [R, W] (packed rows), 0 for the base model (no column).
    None without adapters."""
    if columns is None or adapters is None:
        return None
    per_token = jnp.broadcast_to(adapters[:, None], shape) if adapters.ndim == 1 else adapters
    if stream is not None:
        per_token = invariant.flatten(per_token, stream)  # the stream's padding tokens: 0, the base
    return (per_token[..., None] == columns).astype(F32)


def _frequencies(table: jax.Array, lengths: jax.Array | None) -> jax.Array:
    """Inverse frequencies [R/2], or from a by-length table (dynamic, longrope) per row [B, R/2] (lengths [B]) or
    per token [R, W, R/2] (packed rows: lengths [R, W]); without lengths (the shared-prefix paths) the first row,
    valid because the scorer shares only within the length limit."""
    if table.ndim == 1:
        return table
    if lengths is None:
        return table[0]
    return jnp.take(table, jnp.clip(lengths, 1, table.shape[0]) - 1, axis=0)


def rotary_tables(positions, table, lengths, scaling: float, stream: int | None):
    """cos, sin [B, T, R] of positions [B, T] (inverse frequencies `table`, see _frequencies); `stream`: the tokens
    M of the batch-invariant stream, whose tables [1, M, R] are computed in fixed tiles of tokens (their
    transcendentals too)."""
    freqs = _frequencies(table, lengths)
    if stream is None:
        return rope_tables(positions, freqs, scaling)
    B, T = positions.shape
    per_token = jnp.broadcast_to(freqs if freqs.ndim == 1 else freqs[:, None, :], (B, T, freqs.shape[-1]))
    tables = lambda xs: tuple(a[0] for a in rope_tables(xs[0][None], xs[1][None], scaling))
    return invariant.tokenwise(tables, (invariant.flatten(positions, stream), invariant.flatten(per_token, stream)))
