"""The embedded SmolLM2-135M against transformers loading the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import scorer_for, small_plan

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


def test_bfloat16_logprobs_close_to_transformers_float32(embedded_dir, reference):
    sequences, expected = reference
    scorer = scorer_for(embedded_dir, "bfloat16", small_plan(lengths=(32,), batches=(8,)))
    ours = scorer.score(sequences, LABELS)
    # Plausible labels (the ones scoring compares) within 0.05; bfloat16 weight rounding moves the
    # log-probs of very unlikely labels (< -10) by ~0.5% of their magnitude, so those get 1% relative.
    plausible = expected > -10
    np.testing.assert_allclose(ours[plausible], expected[plausible], atol=0.05, rtol=0)
    np.testing.assert_allclose(ours[~plausible], expected[~plausible], atol=0, rtol=0.01)
    assert plausible.sum() >= 5


def test_tokenizer_matches_transformers_gguf_tokenizer(embedded_dir, torch_embedded):
    from runtime.loader import load_tokenizer

    _, reference_tokenizer = torch_embedded
    tokenizer = load_tokenizer(embedded_dir)
    for text in PROMPTS + ["", " Paris", "naïve café 東京 🙂 <|im_start|>"]:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text)
