"""Parity with transformers' PyTorch implementation on tiny random configs of every supported architecture."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import random_sequences, scorer_for, small_plan, tiny_checkpoint

CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope_scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16},
                                      "rope_theta": 500000.0}),
    "smollm2_like": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1, "rope_theta": 100000.0}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    scorer = scorer_for(tmp_path, "float32", small_plan(lengths=(16, 32), batches=(1, 8)))
    rng = np.random.default_rng(1)
    sequences = random_sequences(rng, 6, 1, 30, 128)
    labels = [0, 5, 127, 64, 5]
    ours = scorer.score(sequences, labels)
    reference = torch_label_logprobs(torch_model, sequences, labels)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 0.5  # weights are random enough that a wrong model could not pass by chance


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_bfloat16_close_to_transformers(case, tmp_path):
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    scorer = scorer_for(tmp_path, "bfloat16", small_plan(lengths=(32,), batches=(8,)))
    sequences = random_sequences(np.random.default_rng(2), 4, 3, 30, 128)
    ours = scorer.score(sequences, [1, 2, 3])
    np.testing.assert_allclose(ours, torch_label_logprobs(torch_model, sequences, [1, 2, 3]), atol=0.05, rtol=0)
