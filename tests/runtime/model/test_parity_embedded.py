"""The embedded SmolLM2-135M against transformers loading the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import scorer_for, small_plan
from tests.runtime.model.test_parity_tiny import ACCELERATOR

PARIS, LONDON = 7042, 4528
PROMPTS = [
    "The capital of France is",
    "I pledge allegiance to the flag",
    "What is 2+2? The answer is",
    "This movie was absolutely terrible and boring. Sentiment:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
LABELS = [PARIS, LONDON, 0, 49151, 253, 314, 2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(torch_embedded):
    model, tokenizer = torch_embedded
    sequences = [tokenizer.encode(prompt) for prompt in PROMPTS]
    return sequences, torch_label_logprobs(model, sequences, LABELS)


def test_paris_logprob_matches_the_documented_value(embedded_dir):
    scorer = scorer_for(embedded_dir, "float32", small_plan(lengths=(32,), batches=(1,)))
    paris, london = scorer.score([[504, 3575, 282, 4649, 314]], [PARIS, LONDON])[0]
    assert paris == pytest.approx(-0.258, abs=1e-3)
    assert london == pytest.approx(-4.384, abs=1e-3)


def test_float32_logprobs_match_transformers(embedded_dir, reference):
    sequences, expected = reference
    scorer = scorer_for(embedded_dir, "float32", small_plan(lengths=(32,), batches=(8,)))
    np.testing.assert_allclose(scorer.score(sequences, LABELS), expected, atol=1e-3, rtol=0)


# bfloat16 rounding is chaotic: which labels move most changes with any change of the float32 path, so the rule is
# on the error's distribution over many prompts, not on a few. Measured on three such prompt sets (41 prompts x 16
# labels each; `plausible`: log-prob > -10): bfloat16 weights with float32 attention mean 0.013-0.015, p99
# 0.051-0.067, max 0.067-0.116 (the implementation before jax.nn.dot_product_attention: mean 0.014, p99
# 0.051-0.060, max 0.053-0.104); with bfloat16 attention as well (GPU cuDNN, TPU) mean 0.017-0.018, p99
# 0.068-0.097, max 0.081-0.231 (one outlier).
BF16_RULES = {"cpu": (0.02, 0.08, 0.15), "accelerator": (0.025, 0.12, 0.3)}  # mean, p99, max of |error|
WORDS = ("the a of to and in is was for on that with as by at from his her it an were are which this be or has had "
         "but not they their one all also new more").split()


@pytest.fixture(scope="module")
def many(torch_embedded):
    model, tokenizer = torch_embedded
    rng = np.random.default_rng(0)
    texts = PROMPTS + [" ".join(rng.choice(WORDS, int(rng.integers(5, 26)))) for _ in range(36)]
    sequences = [tokenizer.encode(text)[:32] for text in texts]
    labels = list(range(250, 259)) + LABELS
    return sequences, labels, torch_label_logprobs(model, sequences, labels)


@pytest.mark.parametrize("kernels", ["cpu", "accelerator"])
def test_bfloat16_logprobs_close_to_transformers_float32(embedded_dir, many, kernels):
    sequences, labels, expected = many
    chosen = ACCELERATOR if kernels == "accelerator" else None  # None: what the CPU platform runs
    scorer = scorer_for(embedded_dir, "bfloat16", small_plan(lengths=(32,), batches=(8,)), kernels=chosen)
    ours = scorer.score(sequences, labels)
    plausible = expected > -10
    error = np.abs(ours - expected)[plausible]
    mean, p99, worst = BF16_RULES[kernels]
    assert plausible.sum() >= 200
    assert error.mean() <= mean and np.percentile(error, 99) <= p99 and error.max() <= worst, \
        (error.mean(), np.percentile(error, 99), error.max())
    # Very unlikely labels move by a fraction of their magnitude (measured on the three sets: p99 0.6-1.3%, max 0.8-2.2%).
    relative = np.abs((ours - expected) / expected)[~plausible]
    assert np.percentile(relative, 99) <= 0.02 and relative.max() <= 0.04, (np.percentile(relative, 99), relative.max())


def test_tokenizer_matches_transformers_gguf_tokenizer(embedded_dir, torch_embedded):
    from runtime.model.loader import load_tokenizer

    _, reference_tokenizer = torch_embedded
    tokenizer = load_tokenizer(embedded_dir)
    for text in PROMPTS + ["", " Paris", "naïve café 東京 🙂 <|im_start|>"]:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text)
