"""Every RoPE scaling type against transformers' own rotary embedding classes: cos and sin (attention scaling
included) at every position of sequences shorter and longer than the length where dynamic and longrope switch;
and config fields this runtime does not compute are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.config import ModelConfigError, config_from_hf
from runtime.model.layers import rope_tables

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=96)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
            "long_factor": [2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0]}
ROPES = {  # case -> (config class, its rotary embedding class, config overrides); switch at 32 tokens where any
    "default": ("LlamaConfig", "LlamaRotaryEmbedding", {"rope_theta": 5000.0}),
    "linear": ("LlamaConfig", "LlamaRotaryEmbedding", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("LlamaConfig", "LlamaRotaryEmbedding", {"max_position_embeddings": 32,
                                                        "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}),
    "yarn": ("Qwen3Config", "Qwen3RotaryEmbedding", {"max_position_embeddings": 128, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "yarn_mscale_untruncated": ("LlamaConfig", "LlamaRotaryEmbedding", {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.9,
        "mscale_all_dim": 0.6, "beta_fast": 16, "beta_slow": 2, "truncate": False}}),
    "llama3": ("LlamaConfig", "LlamaRotaryEmbedding", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "longrope_phi3": ("Phi3Config", "Phi3RotaryEmbedding", {"max_position_embeddings": 128,
                                                            "original_max_position_embeddings": 32,
                                                            "rope_scaling": LONGROPE}),
    "longrope_partial": ("Phi3Config", "Phi3RotaryEmbedding", {
        "max_position_embeddings": 96, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75,
        "rope_scaling": {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                         "long_factor": LONGROPE["long_factor"][:6]}}),
}


def ours(cfg_rope, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [length, R] as the model computes them for a sequence of `length` tokens (float32 cos/sin of
    XLA and PyTorch differ by up to ~4e-6 at angles of ~48 radians, hence 1e-5 below)."""
    table, scaling = cfg_rope.frequency_table(48)
    inv = table[0] if table.shape[0] == 1 else table[length - 1]
    cos, sin = rope_tables(np.arange(length)[None], np.asarray(inv, np.float32), scaling)
    return np.asarray(cos[0]), np.asarray(sin[0])


def theirs(embedding, length: int, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        cos, sin = embedding(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None], **kwargs)
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("case", sorted(ROPES))
def test_cos_and_sin_match_transformers_rotary_embedding(case):
    config_name, embedding_name, overrides = ROPES[case]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    raw = {**config.to_dict(), "architectures": [config_name.replace("Config", "ForCausalLM")]}
    rope = config_from_hf(raw).rope
    for length in (5, 32, 33, 48):  # a switch at 32 tokens (dynamic, longrope) falls between these
        # A fresh embedding per length: transformers' dynamic RoPE keeps the longest sequence's frequencies.
        module = getattr(transformers.models, config.model_type)
        embedding = getattr(getattr(module, f"modeling_{config.model_type}"), embedding_name)(config)
        cos, sin = ours(rope, length)
        their_cos, their_sin = theirs(embedding, length)
        np.testing.assert_allclose(cos, their_cos, atol=1e-5, rtol=0)
        np.testing.assert_allclose(sin, their_sin, atol=1e-5, rtol=0)
    if rope.kind in ("dynamic", "longrope"):
        assert not np.allclose(ours(rope, 48)[0][:32], ours(rope, 32)[0])  # the length matters


def test_gemma3_local_and_global_ropes_match_transformers():
    ropes = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    config = transformers.Gemma3TextConfig(**BASE, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                           rope_parameters=ropes)
    cfg = config_from_hf({**config.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    embedding = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    for rope, layer_type in ((cfg.rope, "full_attention"), (cfg.local_rope, "sliding_attention")):
        cos, sin = ours(rope, 40)
        their_cos, their_sin = theirs(embedding, 40, layer_type=layer_type)
        np.testing.assert_allclose(cos, their_cos, atol=1e-5, rtol=0)
        np.testing.assert_allclose(sin, their_sin, atol=1e-5, rtol=0)
    # The pre-5.0 spelling of the same config: rope_theta + rope_scaling (global), rope_local_base_freq (local).
    old = config_from_hf({**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "rope_theta": 1e6,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 1e4})
    assert (old.rope, old.local_rope) == (cfg.rope, cfg.local_rope)


LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope type 'mrope' is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 2]}},
     "rope parameter(s) mrope_section of type 'linear' are not supported"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "yarn rope scaling is missing ['factor']"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported for this architecture"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope type 'linear' is not supported (supported: default, longrope)"),
    ({"architectures": ["Gemma2ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention=true is not supported"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation 'relu' is not"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention", "chunked_attention"]},
     "layer_types ['chunked_attention'] are not supported"),
])
def test_what_the_runtime_does_not_compute_is_refused_by_name(change, message):
    with pytest.raises(ModelConfigError, match=re_escape(message)):
        config_from_hf({**LLAMA, **change})


def re_escape(text: str) -> str:
    import re

    return re.escape(text)
