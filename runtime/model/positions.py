"""The entry points that read every position of their rows (per-position log-probabilities: /v1/completions, and
the prefix cache's prompts read at every position, runtime.requests.prompt_rows): a part of
runtime.model.transformer.Transformer, which runs the layers (`_run_layers`) and pools and norms the rows; the
readout itself is runtime.model.heads.token_logprobs.

Shapes as in runtime.model.transformer: B batch, T tokens, C context tokens, K KV heads, E head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from runtime.model import heads


class EveryPosition:
    """Transformer's per-position entry points (a mixin: Transformer provides the layers, the pooling and the head)."""

    def token_logprobs(self, tokens: jax.Array, lengths: jax.Array, temperature: jax.Array, seed: jax.Array,
                       adapters: jax.Array):
        """Every position's next-token distribution, read without materializing [B, T, V] logits at once.

        tokens [B, T] right-padded, lengths [B]; per row a sampling temperature [B] (0: the most likely token)
        and seed [B] (uint32) and LoRA adapter [B] (0: the base model). Returns
          next_logprobs [B, T]: log P(tokens[t + 1]) after position t (meaningless at t >= length - 1),
          top_ids, top_logprobs [B, T, heads.TOP_K]: the most likely next tokens after each position, best first,
          next_id, next_logprob [B]: the token chosen after the whole row, and its log-probability."""
        B, T = tokens.shape
        h, _ = self._run_layers(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), lengths=lengths, adapters=adapters)
        return self._read_positions(h, tokens, lengths, temperature, seed)

    def token_logprobs_context(self, tokens: jax.Array, lengths: jax.Array, temperature: jax.Array,
                               seed: jax.Array, adapters: jax.Array):
        """A prompt [1, C] read at every position as token_logprobs reads it, and its keys and values kept as
        prefill_context keeps them (the prefix cache holds both): (keys, values [Layers, C, K, E], then
        token_logprobs' outputs)."""
        _, C = tokens.shape
        h, (k, v) = self._run_layers(tokens, jnp.arange(C)[None], keep_kv=True, lengths=lengths, adapters=adapters)
        return k, v, *self._read_positions(h, tokens, lengths, temperature, seed)

    def token_logprobs_after_context(self, ctx_k, ctx_v, ctx_len, tokens, lengths, temperature, seed, adapters):
        """token_logprobs of rows [B, T] that start at position ctx_len and attend the first ctx_len keys of a cached
        prompt (ctx_k, ctx_v [Layers, C, K, E]) plus their own: the outputs of the rows' own positions (the cached
        prompt's are the cache's)."""
        B, T = tokens.shape
        positions = ctx_len + jnp.broadcast_to(jnp.arange(T), (B, T))
        h, _ = self._run_layers(tokens, positions, (ctx_k, ctx_v, ctx_len), adapters=adapters)
        return self._read_positions(h, tokens, lengths, temperature, seed)

    def _read_positions(self, h, tokens, lengths, temperature, seed):
        """heads.token_logprobs on the layers' output h [B, T, D]."""
        return heads.token_logprobs(self._vocab_head(), h, self._pool(h, lengths - 1), tokens, lengths, temperature,
                                    seed, self._normed, self._rows)
