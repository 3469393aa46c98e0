"""Parity with transformers' PyTorch implementation on tiny random configs of every supported architecture,
on both paths (full sequences; a shared prefix scored as a cascade) and with the accelerators' numerics."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_label_logprobs
from runtime.model.transformer import Kernels
from tests.runtime.conftest import random_sequences, scorer_for, small_plan, tiny_checkpoint

# What GPUs and TPUs run: bfloat16 weights and attention inputs (float32 softmax and accumulation), scanned layers.
# cuDNN cannot run on a CPU; XLA's attention takes the same bfloat16 inputs.
ACCELERATOR = Kernels(attention="xla", attention_dtype="bfloat16")
SHARED = small_plan(lengths=(16, 32), batches=(1, 8), prefix_sharing=True, suffix_lengths=(8,), suffix_batches=(4,))

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


def shared_prefix_requests(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    query = rng.integers(0, 128, 14).tolist()
    return [query + rng.integers(0, 128, n).tolist() for n in (1, 3, 7, 5, 2, 6)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_prefix_cascade_matches_transformers(case, tmp_path):
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    scorer = scorer_for(tmp_path, "float32", SHARED)
    sequences, labels = shared_prefix_requests(4), [0, 5, 127, 64]
    ours = scorer.score(sequences, labels)
    assert scorer.prefix_batches == 2  # one context, six items in two suffix batches of four
    np.testing.assert_allclose(ours, torch_label_logprobs(torch_model, sequences, labels), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral_sliding_window"])
@pytest.mark.parametrize("plan", ["full", "shared"])
def test_accelerator_numerics_close_to_transformers(case, plan, tmp_path):
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    scorer = scorer_for(tmp_path, "bfloat16", SHARED if plan == "shared" else small_plan(lengths=(32,), batches=(8,)),
                        kernels=ACCELERATOR)
    sequences, labels = shared_prefix_requests(5), [1, 2, 3]
    ours = scorer.score(sequences, labels)
    assert (scorer.prefix_batches > 0) == (plan == "shared")
    # These random configs have large weights: bfloat16 weights alone move their log-probs by up to 0.09
    # (measured), bfloat16 attention by up to 0.085 in all. The embedded model's rule is in test_parity_embedded.
    np.testing.assert_allclose(ours, torch_label_logprobs(torch_model, sequences, labels), atol=0.1, rtol=0)
