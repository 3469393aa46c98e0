"""GGUF files of the gemma, gemma2, gemma3 and phi3 architectures, as llama.cpp writes them (the `gguf` package's
tensor names, Gemma norms stored as 1 + weight, Phi-3's longrope factors as tensors), convert into the model they
came from: the same configuration and the same weights. The files are written here with the `gguf` package's writer
from tiny random transformers checkpoints; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from runtime.model.config import load_config
from runtime.model.gguf import convert_gguf
from runtime.model.weights import load_arrays
from tests.runtime.conftest import CASES, tiny_checkpoint

gguf = pytest.importorskip("gguf")

_EXACT_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0, 2.5, 3.0],
                   "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}  # float32-exact: GGUF stores them as float32
GGUF_CASES = {  # arch -> (family, overrides); query_pre_attn_scalar = head_dim, as llama.cpp reads Gemma 2/3
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {**CASES["gemma2"][1], "query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {**CASES["gemma3_local_global_rope"][1], "query_pre_attn_scalar": 16}),
    "phi3": ("phi3", {**CASES["phi3_longrope_partial_sliding"][1], "rope_scaling": _EXACT_LONGROPE}),
}


def write_gguf(model_dir, arch: str, path) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes for these architectures, float32 tensors."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    cfg = load_config(model_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope.theta)
    if arch in ("gemma", "gemma2", "gemma3"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attention_softcap)
        writer.add_final_logit_softcapping(cfg.final_softcap)
    if arch == "gemma3":
        writer.add_sliding_window_pattern(list(cfg.sliding_layers))
        writer.add_rope_freq_base_swa(cfg.local_rope.theta)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope.get("factor"))
        writer.add_final_logit_softcapping(cfg.final_softcap)
    if arch == "phi3":
        writer.add_rope_dimension_count(cfg.rope.rotary_dim)
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(cfg.rope.inverse_frequencies()[1])
        for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
            writer.add_tensor(name, np.asarray(cfg.rope.get(key), np.float32))
    tokens = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(cfg.vocab_size - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(cfg.vocab_size - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (cfg.vocab_size - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_layers)
    for name, value in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + np.float32(1)  # llama.cpp's Gemma converters add the 1 of (1 + weight)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(GGUF_CASES))
def test_gguf_converts_into_the_same_model(arch, tmp_path):
    family, overrides = GGUF_CASES[arch]
    hf_dir, converted = tmp_path / "hf", tmp_path / "converted"
    tiny_checkpoint(family, hf_dir, **overrides)
    write_gguf(hf_dir, arch, tmp_path / f"tiny-{arch}.gguf")
    convert_gguf(tmp_path / f"tiny-{arch}.gguf", converted)

    ours, theirs = load_config(converted), load_config(hf_dir)
    # GGUF metadata is float32 (the norm epsilon, longrope's attention factor): those compare to float32 precision
    unrounded = dict(rope=None, local_rope=None, pad_token_id=None, rms_norm_eps=0.0)
    assert dataclasses.replace(ours, **unrounded) == dataclasses.replace(theirs, **unrounded)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    for mine, reference in ((ours.rope, theirs.rope), (ours.local_rope, theirs.local_rope)):
        if reference is None:
            assert mine is None
            continue
        assert mine.kind == reference.kind and mine.rotary_dim == reference.rotary_dim
        for length in (8, 96):
            got, scale = mine.frequency_table(length)
            expected, expected_scale = reference.frequency_table(length)
            np.testing.assert_allclose(got, expected, rtol=1e-6)
            assert scale == pytest.approx(expected_scale, rel=1e-6)
    arrays, expected = load_arrays(converted, ours), load_arrays(hf_dir, theirs)
    assert arrays.keys() == expected.keys()
    for name in expected:  # Gemma norms went through (w + 1) - 1 in float32
        np.testing.assert_allclose(arrays[name], expected[name], atol=1e-6, rtol=0, err_msg=name)

