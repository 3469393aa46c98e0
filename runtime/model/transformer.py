"""Every supported decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, OLMoE, gpt-oss,
Gemma 1/2/3, Phi-3, Granite, OLMo 2) as one Flax NNX module (Transformer), prefill only: the weights, the trunk (embedding, the loop over the
layers, the final norm) and the entry points the compiled programs run (those that read every position:
runtime.model.positions). The families differ in data
(runtime.model.config.ModelConfig), not in code paths per family: one layer body (runtime.model.decoder_layer) reads
which norms, activation, multipliers, soft-caps and experts apply.

Layers are stacked along a leading axis and run with `lax.scan` (or unrolled where runtime.assembly.platform measured
that it pays): one compiled layer body whatever the depth, so every shape bucket compiles quickly.
Weight matmuls take `dtype` inputs (float32 or bfloat16) and accumulate in float32. Attention runs in
`Kernels.attention_dtype` (runtime.model.kernels) through runtime.model.attention (float32 on CPU: bfloat16
attention moved the embedded model's log-probs by up to 0.06 there; bfloat16 on accelerators, where cuDNN needs it).
Norms, softmax, log-softmax, the residual stream and the embedding/vocabulary head stay in float32. LoRA adapters
(runtime.model.lora) add each token's own adapter's update to the projections; every entry point takes each row's
adapter (0: the base model). What the entry points read from the final hidden states (labels' log-probabilities,
next-token distributions, classification heads) is in runtime.model.heads.

Per-layer differences (Gemma 2/3: sliding or global attention, local or global RoPE base) keep the loop scanned:
they are arrays the scan reads with each layer's weights (`_layer_data`), not Python branches.

Shapes: B batch, T query tokens, S key tokens, C context (shared-prefix) tokens, D hidden,
H heads, K KV heads, G = H // K, E head dim, R rotary dims, F MLP hidden, V vocabulary, L labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runtime.model import attention, heads, invariant, lora, params
from runtime.model.config import ModelConfig
from runtime.model.decoder_layer import DecoderLayer, lora_mask, rotary_tables
from runtime.model.kernels import Kernels
from runtime.model.layers import rms_norm
from runtime.model.positions import EveryPosition

F32 = jnp.float32


def _weights(value: jax.Array) -> jax.Array:
    """A layer's weight as the matmuls take it: bfloat16 weights sliced from a scanned stack come as their bits."""
    return jax.lax.bitcast_convert_type(value, jnp.bfloat16) if value.dtype == jnp.uint16 else value


NO_WINDOW = 2**30  # the window of a global layer among sliding ones: longer than any sequence


def rope_length_limit(cfg: ModelConfig, max_length: int) -> int | None:
    """Sequences up to this length share a prefix; longer ones change their RoPE frequencies (dynamic, longrope),
    so they are scored in full. None: no length served up to `max_length` changes them."""
    limits = [rope.length_limit() for rope in (cfg.rope, cfg.local_rope) if rope is not None]
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits and max_length > min(limits) else None


class Transformer(EveryPosition, nnx.Module):
    """Weights are given as a dict of NumPy arrays in this module's layout (runtime.model.params declares each)."""

    def __init__(self, cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype: str = "float32",
                 kernels: Kernels | None = None, max_length: int | None = None, label_tokens: int = 1):
        """`max_length`: the longest sequence served; a sliding window at least that long never masks anything,
        and RoPE types whose frequencies depend on the length get a table up to it. `label_tokens`: the most
        tokens of a label (the tail the forward passes read: _tails)."""
        self.label_tokens = label_tokens
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.kernels = kernels or Kernels()
        self.attention_dtype = jnp.dtype(self.kernels.attention_dtype)
        window = cfg.sliding_window
        self.window = window if window is not None and (max_length is None or window < max_length) else None
        self.decoder_layer = DecoderLayer(cfg, self.kernels, self.window, self.attention_dtype)

        # Every array's declaration: the model's and its stacked LoRA arrays'. A tuple: an nnx module's static
        # attributes are hashed with its graph.
        declared = params.declare(cfg) | lora.declare(cfg, *lora.stacked_size(arrays))
        self.declared = tuple(declared.values())

        def param(info: params.ParamInfo, layer: int | None = None) -> nnx.Param:
            kept = self.dtype if info.dtype is None else jnp.dtype(info.dtype)
            value = jnp.asarray(arrays[info.name] if layer is None else arrays[info.name][layer], dtype=kept)
            if self.kernels.weight_bits and kept == jnp.bfloat16 and info.stacked and layer is None:
                value = jax.lax.bitcast_convert_type(value, jnp.uint16)  # viewed as bfloat16 again per slice
            return nnx.Param(value)

        self.embed = param(declared["embed"])  # [V, D]
        self.final_norm = param(declared["final_norm"])  # [D]
        self.lm_head = param(declared["lm_head"]) if "lm_head" in declared else None  # [V, D], None when tied
        self.score_head = param(declared["score_head"]) if "score_head" in declared else None  # [labels, D]
        # Every position's head (token_logprobs) multiplies the vocabulary weight in the model's format: a copy made
        # once here, transposed (why: heads.VocabHead.positions_weight); None where the format is float32 or nothing
        # reads positions. Declared (no checkpoint holds it) so that a mesh splits its vocabulary as the embedding's.
        if self.dtype != jnp.dtype(F32) and cfg.task == "causal_lm":
            self.positions_head = nnx.Variable(self._vocab_weight().T.astype(self.dtype))  # [D, V]
            self.declared += (params.ParamInfo("positions_head", (cfg.hidden_size, cfg.vocab_size),
                                               (params.EMBED, params.VOCAB), None, None),)
        else:
            self.positions_head = None
        stacked = sorted((info for info in declared.values() if info.stacked), key=lambda info: info.name)
        if self.kernels.unroll:
            # Each layer's weights are parameters of their own: an unrolled loop over stacked weights copied each
            # layer's out of the stack on every call (XLA:CPU, bfloat16 through float32 and back: 0.8 ms a layer on
            # the embedded model, more than its matmuls for one item; Intel Xeon, 2026-11-26).
            self.layers = nnx.List([nnx.Dict({info.name.removeprefix("layers."): param(info, i) for info in stacked})
                                    for i in range(cfg.num_layers)])
        else:
            self.layers = nnx.Dict({info.name.removeprefix("layers."): param(info) for info in stacked})  # [L, ...]
        # RoPE: inverse frequencies [R/2], or [max_length, R/2] by length where served lengths change them.
        length = max_length or cfg.max_position_embeddings
        table, self.rope_scaling = cfg.rope.frequency_table(length)
        self.inv_freq = nnx.Variable(jnp.asarray(table if table.shape[0] > 1 else table[0], dtype=F32))
        local_table, self.local_rope_scaling = None, 1.0
        if cfg.local_rope is not None:  # Gemma 3's sliding layers
            local_table, self.local_rope_scaling = cfg.local_rope.frequency_table(length)
        self.local_inv_freq = None if local_table is None else nnx.Variable(
            jnp.asarray(local_table if local_table.shape[0] > 1 else local_table[0], dtype=F32))
        self.rope_length_limit = rope_length_limit(cfg, length)
        # LoRA adapters (runtime.model.lora): which adapter (1..S) each column of the stacked updates belongs to;
        # None without adapters (every program's `adapters` argument is then ignored).
        adapted = "lora_columns" in declared
        self.lora_columns = nnx.Variable(jnp.asarray(arrays["lora_columns"], declared["lora_columns"].dtype)) \
            if adapted else None
        # and each slot's classification head [S, labels, D] (float32, as the model's own head; zeros: none)
        self.lora_heads = param(declared["lora_heads"]) if adapted else None

    def _layer_data(self) -> dict[str, jax.Array]:
        """What differs between layers besides weights, as arrays the scan reads with each layer: the attention
        window (Gemma 2/3: sliding or global) and whether the layer uses the local RoPE (Gemma 3)."""
        cfg, data = self.cfg, {}
        sliding = np.asarray(cfg.layer_is_sliding())
        if self.window is not None and not sliding.all():
            data["window"] = jnp.asarray(np.where(sliding, self.window, NO_WINDOW), jnp.int32)  # [Layers]
        if self.local_inv_freq is not None:  # by layer type, whether or not a window masks anything
            data["local_rope"] = jnp.asarray(np.asarray(cfg.sliding_layers or (True,) * cfg.num_layers))  # [Layers]
        return data

    def _run_layers(self, tokens, positions, ctx=None, keep_kv=False, lengths=None, segments=None, adapters=None):
        """`lengths`: each row's length [B] (or each token's sequence length [R, W] in packed rows), for RoPE
        types whose frequencies depend on it (None: the first row). `segments` [R, W]: packed rows. `adapters`:
        each row's LoRA adapter [B] (or each token's [R, W]; 0: the base model)."""
        B, T = tokens.shape
        tiled = self.kernels.batch_invariant and segments is None  # packed rows: not invariant yet
        rows = (B, T) if tiled else None  # the layers on one stream of tokens [1, M, D] (invariant)
        h = jnp.take(self.embed[...], tokens, axis=0).astype(F32)  # [B, T, D]
        if self.cfg.embed_scale != 1.0:
            h = h * self.cfg.embed_scale
        if tiled:
            h = invariant.flatten(h, min_tokens=max(self.kernels.min_rows, self.kernels.stream_chunk),
                                  align=self.kernels.stream_chunk or invariant.STREAM_ALIGN)
        tokens_of_stream = h.shape[1] if tiled else None
        rope = rotary_tables(positions, self.inv_freq[...], lengths, self.rope_scaling, tokens_of_stream)
        columns = None if self.lora_columns is None else self.lora_columns[...]
        lora = lora_mask(columns, adapters, (B, T), tokens_of_stream)
        local = None
        if self.local_inv_freq is not None:
            local = rotary_tables(positions, self.local_inv_freq[...], lengths, self.local_rope_scaling,
                               tokens_of_stream)

        def body(h, xs):
            p, kv = xs
            p = {name: _weights(value) for name, value in p.items()}
            if ctx is None:
                attend = None if segments is None else attention.Packed(segments, positions)
            else:
                attend = (*kv, ctx[2], positions) if segments is None else \
                    attention.Packed(segments, positions, (*kv, ctx[2]))
            h, (k, v) = self.decoder_layer(h, p, (rope, local), attend, rows, lora)
            return h, ((k[0], v[0]) if keep_kv else None)  # keep_kv only for a batch of one (and no context)
        context = (None, None) if ctx is None else ctx[:2]
        if self.kernels.unroll:  # a Python loop over each layer's own parameters
            data, layer_kvs = self._layer_data(), []
            for i, layer in enumerate(self.layers):
                p = {name: value[...] for name, value in layer.items()} | {k: d[i] for k, d in data.items()}
                h, kv = body(h, (p, jax.tree.map(lambda c: c[i], context)))
                layer_kvs.append(kv)
            kv = jax.tree.map(lambda *each: jnp.stack(each), *layer_kvs) if keep_kv else None
        else:
            layers = {name: value[...] for name, value in self.layers.items()} | self._layer_data()
            h, kv = jax.lax.scan(body, h, (layers, context))
        return (h if rows is None else invariant.unflatten(h, rows)), kv

    def _rows(self, fn, xs):
        """fn over rows of `xs` [B, ...]: in fixed tiles of rows for the batch-invariant kernels, else at once."""
        return invariant.rowwise(fn, xs) if self.kernels.batch_invariant else fn(xs)

    def _pool(self, h: jax.Array, last_index: jax.Array) -> jax.Array:
        last = jnp.take_along_axis(h, last_index[:, None, None], axis=1)[:, 0]  # [B, D]
        return self._rows(self._normed, last)

    def _normed(self, h: jax.Array) -> jax.Array:
        return rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)

    # ---- entry points (each jitted per shape bucket by runtime.assembly.executables) --------------------------

    def hidden(self, tokens: jax.Array, last_index: jax.Array, targets: jax.Array, adapters: jax.Array):
        """tokens [B, T] right-padded, last_index [B], targets [B, P] (each row's label tokens on its last positions,
        right-aligned; -1: none), each row's LoRA adapter [B] (0: the base model) -> (final-normed hidden state at
        last_index [B, D] float32, the targets' log-probabilities [B, P] float32: _tails)."""
        B, T = tokens.shape
        h, _ = self._run_layers(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), lengths=last_index + 1,
                                adapters=adapters)
        return self._pool(h, last_index), self._tails(h.reshape(B * T, -1), last_index + jnp.arange(B) * T, targets)

    def prefill_context(self, tokens: jax.Array, adapters: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [1, C] right-padded, their LoRA adapter [1] -> rotated keys and values of every layer, each
        [Layers, C, K, E] in the attention dtype."""
        _, C = tokens.shape
        _, (k, v) = self._run_layers(tokens, jnp.arange(C)[None], keep_kv=True, adapters=adapters)
        return k, v

    def extend_context(self, ctx_k, ctx_v, ctx_len, tokens, adapters) -> tuple[jax.Array, jax.Array]:
        """A cached context's keys and values (ctx_k, ctx_v [Layers, C, K, E], its first ctx_len positions) extended by
        the tokens after them, tokens [1, S] right-padded at positions ctx_len.., attending them: the keys and values
        of the longer prefix, [Layers, C, K, E] (positions past it hold padding's, which no reader attends; those past
        C are dropped)."""
        _, S = tokens.shape
        _, (k, v) = self._run_layers(tokens, ctx_len + jnp.arange(S)[None], (ctx_k, ctx_v, ctx_len), keep_kv=True,
                                     adapters=adapters)
        at = jnp.arange(ctx_k.shape[1]) - ctx_len  # each context position's index into the new tokens
        new = ((at >= 0) & (at < S))[None, :, None, None]
        return tuple(jnp.where(new, jnp.take(own, jnp.clip(at, 0, S - 1), axis=1), old)
                     for own, old in ((k, ctx_k), (v, ctx_v)))

    def hidden_after_context(self, ctx_k, ctx_v, ctx_len, tokens, last_index, targets, adapters):
        """Score continuations of a shared prefix: tokens [B, T] start at position ctx_len and attend to
        the first ctx_len context keys (ctx_k, ctx_v [Layers, C, K, E]) plus their own causal keys; targets and
        each row's LoRA adapter [B] (the context's own) as in `hidden`. Returns what `hidden` returns."""
        B, T = tokens.shape
        positions = ctx_len + jnp.broadcast_to(jnp.arange(T), (B, T))
        h, _ = self._run_layers(tokens, positions, (ctx_k, ctx_v, ctx_len), adapters=adapters)
        return self._pool(h, last_index), self._tails(h.reshape(B * T, -1), last_index + jnp.arange(B) * T, targets)

    def hidden_packed(self, tokens: jax.Array, positions: jax.Array, segments: jax.Array,
                      last_index: jax.Array, targets: jax.Array, adapters: jax.Array):
        """Several whole sequences per row (runtime.shapes.packed): tokens, positions (from 0 in each sequence)
        and segments (-1: padding) [R, W]; last_index [M]: flat indices into R * W of each sequence's last token;
        targets [M, P] as in `hidden`; each token's LoRA adapter [R, W]. Returns the final-normed hidden states
        there [M, D] float32 and the targets' log-probabilities [M, P]."""
        h, _ = self._run_layers(tokens, positions, lengths=self._packed_lengths(segments), segments=segments,
                                adapters=adapters)
        return self._pool_flat(h, last_index), self._tails(h.reshape(-1, h.shape[-1]), last_index, targets)

    def _packed_lengths(self, segments: jax.Array) -> jax.Array | None:
        """Each token's sequence length [R, W] (the tokens of its segment in its row), for RoPE frequencies that
        depend on it (dynamic, longrope): each packed sequence rotates as it would alone. None otherwise."""
        tables = (self.inv_freq, self.local_inv_freq)
        if not any(table is not None and table[...].ndim == 2 for table in tables):
            return None
        return jnp.sum(segments[:, :, None] == segments[:, None, :], axis=-1, dtype=jnp.int32)

    def hidden_packed_after_context(self, ctx_k, ctx_v, ctx_len, tokens, positions, segments,
                                    last_index, targets, adapters):
        """Continuations of a shared prefix packed into rows: as hidden_packed, with positions from ctx_len, and
        every token also attends the context's first ctx_len keys (ctx_k, ctx_v [Layers, C, K, E])."""
        h, _ = self._run_layers(tokens, positions, (ctx_k, ctx_v, ctx_len), segments=segments, adapters=adapters)
        return self._pool_flat(h, last_index), self._tails(h.reshape(-1, h.shape[-1]), last_index, targets)

    def _tails(self, flat: jax.Array, last: jax.Array, targets: jax.Array) -> jax.Array:
        """A label of several tokens scored on the rows holding its sequence and all but its last token: the
        hidden states flat [N, D] (every position of the batch) at the P positions ending at each read row's last
        index (`last` [M], flat), each with the token it predicts (targets [M, P], right-aligned; -1: none) ->
        log P(target) [M, P] float32, by the vocabulary head that reads a single-token label (so a label's first
        token has the bits the single-token path gives it). Computed only when a target is there."""
        M, P = targets.shape

        def read():
            at = jnp.clip(last[:, None] - (P - 1) + jnp.arange(P), 0, flat.shape[0] - 1)  # [M, P]
            normed = self._rows(self._normed, jnp.take(flat, at.reshape(M * P), axis=0))
            return self.label_logprobs(normed, jnp.maximum(targets, 0).reshape(M * P, 1)).reshape(M, P)
        return jax.lax.cond(jnp.any(targets >= 0), read, lambda: jnp.zeros((M, P), F32))

    def _pool_flat(self, h: jax.Array, last_index: jax.Array) -> jax.Array:
        R, W, D = h.shape
        last = jnp.take(h.reshape(R * W, D), last_index, axis=0)  # [M, D]
        return self._normed(last)

    def _vocab_weight(self) -> jax.Array:
        """The vocabulary projection's weight [V, D]: the embedding when the model ties them."""
        return (self.embed if self.lm_head is None else self.lm_head)[...]

    def _vocab_head(self) -> heads.VocabHead:
        """The vocabulary projection (the embedding when the model ties them) and the family's logit changes."""
        return heads.VocabHead(self._vocab_weight(), self.cfg.logits_divisor, self.cfg.final_softcap,
                               self.kernels.head_rows if self.kernels.batch_invariant else None,
                               None if self.positions_head is None else self.positions_head[...])

    def label_logprobs(self, hidden: jax.Array, labels: jax.Array) -> jax.Array:
        """hidden [B, D], labels [B, L] (per row) -> log P(label) over the full vocabulary [B, L] float32."""
        return heads.label_logprobs(self._vocab_head(), hidden, labels)

    def lora_class_logits(self, hidden: jax.Array, adapters: jax.Array) -> jax.Array:
        """A classification adapter's own head (runtime.model.lora): hidden [B, D] and each row's adapter [B] ->
        raw logits [B, MAX_HEAD_LABELS] float32 (past an adapter's labels: 0)."""
        return heads.lora_class_logits(self.lora_heads[...], hidden, adapters, self._rows)

    def class_logits(self, hidden: jax.Array) -> jax.Array:
        """Sequence-classification head: hidden [B, D] -> raw logits [B, num_labels] float32."""
        return heads.class_logits(self.score_head[...], hidden, self._rows)
