"""Parity with transformers' PyTorch implementation on tiny random configs of every supported architecture and RoPE
type (tests.runtime.conftest.CASES), on both paths (full sequences; a shared prefix scored as a cascade) and with
the accelerators' numerics. Per-position log-probabilities: test_token_logprobs.py, on the same compiled scorers."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from runtime.model.kernels import Kernels
from runtime.requests.jobs import Job
from runtime.requests.prefix_cache import PrefixCache
from runtime.requests.scorer import Scorer
from tests.conftest import assert_bfloat16_within_baseline, torch_label_logprobs
from tests.runtime.conftest import CASES, random_sequences, scorer_for, small_plan, tiny_checkpoint

# What GPUs and TPUs run: bfloat16 weights and attention inputs (float32 softmax and accumulation), scanned layers.
# cuDNN cannot run on a CPU; XLA's attention takes the same bfloat16 inputs.
ACCELERATOR = Kernels(attention="xla", attention_dtype="bfloat16")
SHARED = small_plan(lengths=(16, 32), batches=(1, 8), prefix_sharing=True, suffix_lengths=(8,), suffix_batches=(4,))


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_logprobs_match_transformers(tiny_case):
    torch_model, scorer = tiny_case
    rng = np.random.default_rng(1)
    # Lengths 1..32 in one padded batch: beyond 24 tokens dynamic and longrope RoPE change their frequencies.
    sequences = random_sequences(rng, 6, 1, 30, 128) + random_sequences(rng, 1, 31, 31, 128)
    labels = [0, 5, 127, 64, 5]
    shared_before = scorer.prefix_batches
    ours = scorer.score(sequences, labels)
    assert scorer.prefix_batches == shared_before  # no common prefix: every sequence in full
    reference = torch_label_logprobs(torch_model, sequences, labels)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.ptp(reference) > 0.5  # weights are random enough that a wrong model could not pass by chance
    # Padding never changes a score: the shortest sequence alone (with seven padding rows) as in the batch.
    row = int(np.argmin([len(s) for s in sequences]))
    np.testing.assert_allclose(scorer.score([sequences[row]], labels)[0], ours[row], atol=1e-5, rtol=0)


@pytest.mark.parametrize("loop", ["scan", "unroll"])
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_bfloat16_close_to_transformers(case, loop, tmp_path):
    """bfloat16 on either layer loop: scanned (the stacked weights held as their bits) or unrolled (each layer's
    weights its own parameters)."""
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    kernels = Kernels(unroll=loop == "unroll", batch_invariant=True, weight_bits=True)
    scorer = scorer_for(tmp_path, "bfloat16", small_plan(lengths=(32,), batches=(8,)), kernels=kernels)
    sequences, labels = BFLOAT16_REQUESTS, list(range(1, 17))
    assert_bfloat16_within_baseline(scorer.score(sequences, labels), torch_bfloat16(torch_model, sequences, labels),
                                    torch_label_logprobs(torch_model, sequences, labels), f"{case}, {loop}",
                                    TINY_MAX_MARGIN)


def test_the_unrolled_loop_matches_the_scanned_one(tmp_path):
    family, overrides = CASES["qwen3"]
    tiny_checkpoint(family, tmp_path, **overrides)
    plan, sequences = small_plan(lengths=(32,), batches=(8,)), random_sequences(np.random.default_rng(3), 5, 3, 30, 128)
    scanned, unrolled = (scorer_for(tmp_path, "float32", plan, kernels=Kernels(unroll=unroll, batch_invariant=True))
                         for unroll in (False, True))
    np.testing.assert_allclose(unrolled.score(sequences, [1, 2]), scanned.score(sequences, [1, 2]), atol=1e-5, rtol=0)


def shared_prefix_requests(seed: int, query: int = 34, items=(1, 3, 7, 5, 2, 6)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    query_tokens = rng.integers(0, 128, query).tolist()
    return [query_tokens + rng.integers(0, 128, n).tolist() for n in items]


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_shared_prefix_cascade_matches_transformers(tiny_case):
    torch_model, scorer = tiny_case
    # A 34-token query (the batch-invariant kernels share its first 32 tokens) and six items: shared, unless their
    # RoPE frequencies depend on the length (dynamic, longrope: beyond 24 tokens; scored in full).
    sequences, labels = shared_prefix_requests(4), [0, 5, 127, 64, 5]
    shared_before = scorer.prefix_batches
    ours = scorer.score(sequences, labels)
    # one context, six items in two suffix batches of four
    assert scorer.prefix_batches - shared_before == (2 if scorer.rope_length_limit is None else 0)
    np.testing.assert_allclose(ours, torch_label_logprobs(torch_model, sequences, labels), atol=1e-4, rtol=0)
    longer = shared_prefix_requests(5, query=40, items=(3, 8, 5, 6, 4))  # 43-48 tokens
    shared_before = scorer.prefix_batches
    ours = scorer.score(longer, labels)
    assert (scorer.prefix_batches > shared_before) == (scorer.rope_length_limit is None)
    np.testing.assert_allclose(ours, torch_label_logprobs(torch_model, longer, labels), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_a_cached_query_gives_the_bits_of_a_miss_and_of_no_cache(tiny_case):
    """The prefix cache (runtime.requests.prefix_cache) on every family: a query scored, then scored again from the
    cache with the same items and with others; every score equal to a scorer's without a cache."""
    _, plain = tiny_case
    cached = Scorer(plain.plan, plain.exe, 1, prefix_cache=PrefixCache(1 << 28))
    labels = (0, 5, 127, 64, 5)
    first, again = shared_prefix_requests(4), shared_prefix_requests(4)
    others = [first[0][:34] + item for item in ([9, 9], [1], [100, 2, 3])]
    results = []
    for sequences in (first, again, others):
        dispatched = cached.dispatch([Job(sequences, labels)])
        results.append((sequences, cached.collect(dispatched)[0], dispatched.cached_tokens[0]))
    held = [hit for _, _, hit in results]
    assert held == ([0, 34 * len(again), 34 * len(others)] if plain.rope_length_limit is None else [0, 0, 0])
    for sequences, ours, _ in results:
        assert np.array_equal(ours, plain.score(sequences, labels))


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_a_context_extended_past_its_cached_part_has_the_bits_of_one_computed_whole(tiny_case):
    """extend_context on every family (the prefix cache's extension of a cached context by the tokens after it): a
    34-token context extended by 10 tokens holds, at its 44 positions, the keys and values prefill_context computes
    for the 44 tokens at once (np.array_equal), so every score read after it has the bits of a miss."""
    _, plain = tiny_case
    query = shared_prefix_requests(6, query=44)[0][:44]
    adapter = np.zeros((1,), np.int32)

    def context(tokens: list[int]) -> tuple:
        padded = np.zeros((1, 64), np.int32)
        padded[0, : len(tokens)] = tokens
        return plain.exe("prefill_context", (64,), padded, adapter)
    rest = np.zeros((1, 64), np.int32)
    rest[0, :10] = query[34:]
    extended = plain.exe("extend_context", (64, 64), *context(query[:34]), np.int32(34), rest, adapter)
    for ours, whole in zip(extended, context(query), strict=True):
        assert np.array_equal(np.asarray(ours)[:, :44], np.asarray(whole)[:, :44])


@pytest.mark.parametrize("case, plan", [(case, plan) for case in ("llama", "qwen2", "qwen3", "mistral_sliding_window")
                                        for plan in ("full", "shared")] + [("gemma2", "shared")])
def test_accelerator_numerics_close_to_transformers(case, plan, tmp_path):
    family, overrides = CASES[case]
    torch_model = tiny_checkpoint(family, tmp_path, **overrides)
    scorer = scorer_for(tmp_path, "bfloat16", SHARED if plan == "shared" else small_plan(lengths=(32,), batches=(8,)),
                        kernels=ACCELERATOR)
    labels = list(range(1, 17))
    ours = [scorer.score(sequences, labels) for sequences in BFLOAT16_PREFIXED]  # each shares its query
    assert (scorer.prefix_batches > 0) == (plan == "shared")
    sequences = sum(BFLOAT16_PREFIXED, [])
    assert_bfloat16_within_baseline(np.concatenate(ours), torch_bfloat16(torch_model, sequences, labels),
                                    torch_label_logprobs(torch_model, sequences, labels), f"{case}, {plan}",
                                    TINY_MAX_MARGIN)


# The bfloat16 rule on tiny random configs (tests.conftest.assert_bfloat16_within_baseline) over 768 label
# log-probabilities each. Their max against transformers bfloat16's max, measured (AMD EPYC Zen 4, 2026-11-26): over
# 20 draws of 192 values, 0.35-1.06; over 768, 0.35-0.88 (mean 0.53-0.70, p99 0.47-0.94). A single maximum is one
# outlier of a chaotic rounding, so the tiny configs' max bound has a margin; the embedded model's has none.
TINY_MAX_MARGIN = 1.25
BFLOAT16_PREFIXED = [shared_prefix_requests(seed, query=14, items=(1, 3, 7, 5, 2, 6, 4, 8, 1, 2, 3, 5))
                     for seed in range(4)]  # 48 sequences of 15-22 tokens, 12 after each query
BFLOAT16_REQUESTS = random_sequences(np.random.default_rng(2), 48, 3, 30, 128)


def torch_bfloat16(torch_model, sequences, labels):
    """transformers bfloat16 on the same weights: the baseline of the bfloat16 exactness rule."""
    import torch

    return torch_label_logprobs(copy.deepcopy(torch_model).to(torch.bfloat16), sequences, labels)
