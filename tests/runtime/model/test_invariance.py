"""Batch-invariant kernels (runtime.model.invariant), as the CPU platform runs them (tests.runtime.conftest.scorer_for:
sized by this host's matmul bit classes): an item's scores are the same bits alone and in any batch, at any row, in any
length bucket, for every supported architecture and RoPE type and at the embedded model's shapes (embedded_shaped_dir:
its layers at 2 of 30, each the same scanned body), and they match transformers as the default kernels do
(tests/runtime/model/test_parity_tiny.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from runtime.interface import Sampling
from runtime.model import invariant
from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import (CASES, FreshRope, assert_whole_sequence_bits_after_a_prefix, platform_kernels,
                                    random_sequences, scorer_for, small_plan, tiny_checkpoint)

pytestmark = pytest.mark.slow
PLAN = small_plan(lengths=(32, 64), batches=(1, 4), labels=(4,))  # 1 to 8 tiles of 32 tokens
# One case per family, with its richest RoPE, biases, windows, soft-caps and experts (compiles cost ~5 s a case).
FAMILY_CASES = ["gemma", "gemma2", "gemma3_local_global_rope", "gpt_oss", "granite_dynamic_rope",
                "llama3_rope_scaling", "llama_biases", "mistral_sliding_window", "mixtral_sliding_window",
                "olmo2_yarn_rope", "olmoe", "phi3_longrope_partial_sliding", "qwen2", "qwen3", "qwen3_moe_linear_rope",
                "smollm2_like"]
# Prefixes longer than a key block (runtime.model.invariant.KEY_BLOCK): whole blocks sliced from the prefix.
LONG_PLAN = small_plan(lengths=(64, 192), batches=(1, 4), labels=(4,))
LONG_PREFIX_PLAN = small_plan(lengths=(64, 192), batches=(1, 4), prefix_sharing=True, suffix_lengths=(8, 32),
                              suffix_batches=(1, 4), labels=(4,), contexts=(64, 192))
# The attention variants the cascade must reproduce: plain, soft-capped, sliding, local/global, q/k norms, experts,
# sinks.
CASCADE_CASES = ["gemma2", "gemma3_local_global_rope", "gpt_oss", "mistral_sliding_window", "olmo2_yarn_rope",
                 "qwen3_moe_linear_rope", "smollm2_like"]
VOCAB = 128  # the tiny configs'


@pytest.fixture(scope="module", params=FAMILY_CASES)
def scorers(request, tmp_path_factory):
    """(PyTorch reference, invariant float32 scorer) of one tiny case."""
    family, overrides = CASES[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    torch_model = tiny_checkpoint(family, model_dir, **overrides)
    return FreshRope(torch_model), scorer_for(model_dir, "float32", PLAN)


batches = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "length": st.integers(1, 64),
    "others": st.integers(0, 6),  # two device batches of 4 at most
    "row": st.integers(0, 6),
})


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches)
def test_an_item_scores_the_same_bits_in_any_batch(scorers, batch):
    _, invariant = scorers
    rng = np.random.default_rng(batch["seed"])
    item = rng.integers(0, VOCAB, batch["length"]).tolist()
    others = random_sequences(rng, batch["others"], 1, 64, VOCAB)
    row = min(batch["row"], len(others))
    labels = [0, 5, VOCAB - 1, 5]
    alone = invariant.score([item], labels)[0]
    together = invariant.score(others[:row] + [item] + others[row:], labels)
    assert np.array_equal(together[row], alone), (together[row], alone)


def test_invariant_scores_match_transformers(scorers):
    torch_model, invariant = scorers
    # Lengths 1..64 in one padded batch: beyond 24 tokens dynamic and longrope RoPE change their frequencies.
    sequences = random_sequences(np.random.default_rng(1), 6, 1, 63, VOCAB) + [[7] * 64]
    labels = [0, 5, VOCAB - 1, 64]
    reference = torch_label_logprobs(torch_model, sequences, labels)
    np.testing.assert_allclose(invariant.score(sequences, labels), reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedded_models_shapes_are_invariant(embedded_shaped_dir, dtype):
    """The embedded model's shapes in both number formats: the default kernels differ by row and bucket, these do
    not."""
    scorer = scorer_for(embedded_shaped_dir, dtype, PLAN)
    rng = np.random.default_rng(0)
    item = [504, 3575, 282, 4649, 314]
    labels = [7042, 4528, 11]
    alone = scorer.score([item], labels)[0]
    others = random_sequences(rng, 6, 1, 64, 49152)
    for row in (0, 3, 6):
        together = scorer.score(others[:row] + [item] + others[row:], labels)
        assert np.array_equal(together[row], alone), (dtype, row)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thousands_of_tokens_keep_the_bits(embedded_shaped_dir, dtype):
    """4,096 tokens in one device batch: over so many XLA:CPU reduced a row of the 576-wide RMSNorm in another order
    than over fewer (Intel Xeon, 2026-11-26); the norms run in fixed tiles of tokens."""
    plan = small_plan(lengths=(128,), batches=(1, 32), labels=(4,), max_tokens=4096)
    scorer = scorer_for(embedded_shaped_dir, dtype, plan)
    rng = np.random.default_rng(3)
    item, labels = rng.integers(0, 49152, 100).tolist(), [7042, 4528, 11]
    others = random_sequences(rng, 31, 120, 128, 49152)
    assert np.array_equal(scorer.score(others[:9] + [item] + others[9:], labels)[9], scorer.score([item], labels)[0])


@pytest.fixture(scope="module", params=CASCADE_CASES)
def cascade(request, tmp_path_factory):
    """(invariant scorer of whole sequences, invariant scorer that shares prefixes) of one tiny case."""
    family, overrides = CASES[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(family, model_dir, **overrides)
    return scorer_for(model_dir, "float32", LONG_PLAN), \
        scorer_for(model_dir, "float32", LONG_PREFIX_PLAN)


prefixed = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "prefix": st.integers(20, 160),  # any length: items start mid-tile, mid-block, after whole blocks
    "items": st.integers(4, 6),  # fewer cost less in full, and are scored so
})


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=prefixed)
def test_items_after_a_shared_prefix_score_the_bits_of_their_whole_sequence(cascade, request):
    full, shared = cascade
    rng = np.random.default_rng(request["seed"])
    prefix = rng.integers(0, VOCAB, request["prefix"]).tolist()
    items = random_sequences(rng, request["items"], 1, 32, VOCAB)  # suffix rows of 32
    sequences = [prefix + item for item in items]
    assert_whole_sequence_bits_after_a_prefix(shared, full, sequences, [0, 5, VOCAB - 1, 5])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedded_models_shapes_score_the_same_bits_after_a_shared_prefix(embedded_shaped_dir, dtype):
    """A prefix longer than a key block: its whole block sliced from the prefix, the next one across its end."""
    full = scorer_for(embedded_shaped_dir, dtype, LONG_PLAN)
    shared = scorer_for(embedded_shaped_dir, dtype, LONG_PREFIX_PLAN)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 49152, invariant.KEY_BLOCK + 6).tolist()
    sequences = [prefix + item for item in random_sequences(rng, 5, 1, 27, 49152)]
    assert_whole_sequence_bits_after_a_prefix(shared, full, sequences, [7042, 4528, 11])


def assert_same_token_logprobs(ours, theirs, note=""):
    for name in ("next_logprobs", "top_ids", "top_logprobs", "next_id", "next_logprob"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), (name, note)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_position_has_the_same_bits_in_any_batch(embedded_shaped_dir, dtype):
    """/v1/completions' per-position log-probabilities and top alternatives, greedy and drawn at a temperature."""
    scorer = scorer_for(embedded_shaped_dir, dtype, dataclasses.replace(PLAN, completion_batches=(1, 4)))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 49152, 19).tolist()
    others = random_sequences(rng, 5, 1, 64, 49152)
    for sampling in (Sampling(), Sampling(temperature=0.7, seed=11)):
        alone = scorer.token_logprobs([prompt], [sampling])[0]
        for row in (0, 2, 5):
            batch = others[:row] + [prompt] + others[row:]
            together = scorer.token_logprobs(batch, [Sampling()] * row + [sampling] + [Sampling()] * (5 - row))
            assert_same_token_logprobs(together[row], alone, (dtype, sampling, row))


@pytest.mark.parametrize("case", ["embedded-float32", "embedded-bfloat16", "qwen3_moe_linear_rope", "gemma2"])
def test_kernels_sized_from_more_rows_than_the_floor_give_the_same_bits(case, embedded_shaped_dir, tmp_path):
    """What runtime.assembly.bitclasses measured: a matmul's rows keep their bits from the floor up (and the label
    head's within the span measured), so kernels sized by this host's measurements and the portable ones (MIN_ROWS
    and tiles of TILE: the sets compiled for another CPU class) give every item the same bits, alone, in batches and
    after a shared prefix."""
    if case.startswith("embedded"):
        model_dir, dtype, vocab = embedded_shaped_dir, case.split("-")[1], 49152
    else:
        family, overrides = CASES[case]
        tiny_checkpoint(family, tmp_path, **overrides)
        model_dir, dtype, vocab = tmp_path, "float32", VOCAB
    kernels = platform_kernels(model_dir, dtype)
    assert kernels.min_rows <= invariant.MIN_ROWS and kernels.head_rows[0] <= invariant.TILE <= kernels.head_rows[1]
    portable = dataclasses.replace(kernels, min_rows=invariant.MIN_ROWS, head_rows=(invariant.TILE, invariant.TILE))
    scorers = [scorer_for(model_dir, dtype, LONG_PREFIX_PLAN, kernels=each) for each in (kernels, portable)]
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, vocab, 70).tolist()
    requests = [random_sequences(rng, 1, 3, 40, vocab), random_sequences(rng, 6, 1, 64, vocab),
                [prefix + item for item in random_sequences(rng, 5, 1, 30, vocab)]]
    labels = [0, 5, vocab - 1]
    for sequences in requests:
        floor, default = (scorer.score(sequences, labels) for scorer in scorers)
        assert np.array_equal(floor, default), (case, kernels.min_rows, np.abs(floor - default).max())
