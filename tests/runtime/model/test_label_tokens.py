"""Labels of several tokens (runtime.requests.jobs.label_rows): a label's log-probability is the sum of its tokens'
log-probabilities after the prompt, each token after the ones before it. Parity with transformers on every tiny
architecture and on the embedded model, and bitwise invariance: a label's first token has the single-token path's
bits, and an item's label scores are the same alone, among other items and among other labels."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.requests.jobs import Job, label_rows, label_scores, shareable_prefix
from tests.runtime.conftest import CASES, random_sequences, scorer_for, small_plan

LABELS = [[5], [7, 9], [1, 2, 3, 4], [11, 12, 13, 14, 15, 16, 17]]


def torch_label_sums(model, sequences, labels) -> np.ndarray:
    """Reference: each prompt + label (but its last token) alone, the label tokens' log-probabilities summed in
    float64."""
    import torch

    out = np.zeros((len(sequences), len(labels)))
    with torch.no_grad():
        for i, sequence in enumerate(sequences):
            for j, label in enumerate(labels):
                logits = model(torch.tensor([list(sequence) + list(label[:-1])])).logits[0].double()
                logprobs = torch.log_softmax(logits, dim=-1)
                out[i, j] = sum(float(logprobs[len(sequence) - 1 + t, token]) for t, token in enumerate(label))
    return out


def scored(scorer, sequences, labels):
    return label_scores(scorer.score_jobs([label_rows(sequences, labels)])[0], labels)


def test_a_shared_context_leaves_every_read_position_to_the_rows():
    item = [3, 1, 4, 1, 5]
    assert shareable_prefix(Job([item, item + [2]], (7,))) == 4  # the shorter row reads its last position
    # Each label's first token is read at item[-1] (position 4), not at its rows' last positions.
    assert shareable_prefix(label_rows([item], [[7, 9], [8, 8, 8]])) == 4
    assert shareable_prefix(label_rows([item, [3, 1]], [[7], [8, 8]])) == 1  # read at [3, 1]'s 1 first
    assert shareable_prefix(label_rows([item], [[7]])) == 0  # one row: nothing to share


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_label_sums_match_transformers_and_keep_their_bits(tiny_case):
    torch_model, scorer = tiny_case
    rng = np.random.default_rng(7)
    query = rng.integers(0, 128, 20).tolist()
    sequences = [query + item for item in random_sequences(rng, 3, 1, 6, 128)] + random_sequences(rng, 1, 2, 9, 128)
    sums, per_token = scored(scorer, sequences, LABELS)
    np.testing.assert_allclose(sums, torch_label_sums(torch_model, sequences, LABELS), atol=1e-4, rtol=0)
    assert [len(tokens) for tokens in per_token[0]] == [len(label) for label in LABELS]
    # A label's first token is what the single-token path scores, bit for bit (unless RoPE's frequencies depend on
    # the length, as dynamic and longrope's do: then the label's later tokens change the prompt's, in transformers
    # too).
    single = scorer.score(sequences, [label[0] for label in LABELS])
    firsts = np.array([[tokens[0] for tokens in row] for row in per_token])
    assert np.array_equal(firsts, single) or scorer.rope_length_limit is not None
    # An item alone, and a label among other labels or alone, keep their bits.
    alone, _ = scored(scorer, sequences[1:2], LABELS)
    assert np.array_equal(alone[0], sums[1])
    only, _ = scored(scorer, sequences, LABELS[2:3])
    assert np.array_equal(only[:, 0], sums[:, 2])
    # One item, every label of several tokens: its rows share the whole item, and each label's first token is
    # predicted by the item's last position, which a shared context must leave to the rows (shareable_prefix).
    tails_only, _ = scored(scorer, sequences[1:2], LABELS[1:])
    assert np.array_equal(tails_only[0], sums[1, 1:])


@pytest.mark.slow
def test_the_embedded_model_sums_labels_like_transformers(embedded_dir, torch_embedded):
    model, tokenizer = torch_embedded
    prompts = ["Question: What is the capital of France?\nAnswer:", "The movie was wonderful. Overall it was"]
    sequences = [tokenizer.encode(prompt) for prompt in prompts]
    labels = [tokenizer.encode(text) for text in (" Paris", " Lyon, a city in France", " very good", " bad")]
    assert max(len(label) for label in labels) > 2
    scorer = scorer_for(embedded_dir, "float32", small_plan(lengths=(32,), batches=(8,), labels=(4,)))
    sums, _ = scored(scorer, sequences, labels)
    np.testing.assert_allclose(sums, torch_label_sums(model, sequences, labels), atol=1e-4, rtol=0)
    assert sums[0, 0] > sums[0, 1]  # the answer alone is likelier than the answer and more
