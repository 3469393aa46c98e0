"""Per-position log-probabilities (what /v1/completions echoes) against transformers on the same weights: every
position's next-token log-probability, the top tokens, the chosen next token, chunked head, sampling."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.model import heads
from runtime.model.kernels import Kernels
from runtime.interface import MAX_TOP_LOGPROBS, Sampling
from runtime.requests.jobs import TokenJob
from runtime.requests.prefix_cache import BLOCK, PrefixCache
from runtime.requests.scorer import Scorer
from tests.runtime.conftest import CASES, random_sequences, scorer_for, small_plan, tiny_checkpoint

PLAN = small_plan(lengths=(16, 32), batches=(1, 8))


def plan_with_completions(**changes):
    return dataclasses.replace(PLAN, completion_batches=(1, 4), **changes)


def torch_log_softmax(model, sequence):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()  # [T, V]


def assert_matches(ours, reference, sequence, atol):
    """next_logprobs, the top tokens (ties aside) and their log-probabilities against a [T, V] log-softmax."""
    T = len(sequence)
    expected_next = reference[np.arange(T - 1), sequence[1:]]
    np.testing.assert_allclose(ours.next_logprobs, expected_next, atol=atol, rtol=0)
    order = np.argsort(-reference, axis=1)[:, :MAX_TOP_LOGPROBS]
    np.testing.assert_allclose(ours.top_logprobs, np.take_along_axis(reference, order, axis=1), atol=atol, rtol=0)
    values = np.sort(-reference, axis=1)
    for t in range(T):  # the same ids where the reference separates neighbours by more than the tolerance
        gaps = np.diff(values[t, : MAX_TOP_LOGPROBS + 1])
        clear = np.concatenate([[True], gaps[:-1] > 2 * atol]) & (gaps > 2 * atol)
        assert (ours.top_ids[t][clear] == order[t][clear]).all(), t
    assert ours.next_id == ours.top_ids[T - 1, 0] and ours.next_logprob == ours.top_logprobs[T - 1, 0]


@pytest.mark.parametrize("tiny_case", sorted(CASES), indirect=True)
def test_every_position_matches_transformers(tiny_case):
    torch_model, scorer = tiny_case  # the scorer test_parity_tiny checks, with completion buckets
    rng = np.random.default_rng(7)
    sequences = random_sequences(rng, 3, 2, 30, 128) + random_sequences(rng, 1, 28, 32, 128)  # and one > 24 tokens
    for ours, sequence in zip(scorer.token_logprobs(sequences), sequences):
        assert_matches(ours, torch_log_softmax(torch_model, sequence), sequence, atol=1e-4)


def test_the_head_runs_in_chunks_of_positions_with_the_same_results(tmp_path, monkeypatch):
    """The default kernels' head (the accelerators' path; the CPU runs the batch-invariant one, in tiles of positions)
    over chunks of positions: the same results as over all positions at once, and as transformers."""
    torch_model = tiny_checkpoint("llama", tmp_path)
    sequences = random_sequences(np.random.default_rng(8), 4, 20, 32, 128)
    whole = scorer_for(tmp_path, "float32", plan_with_completions(), kernels=Kernels()).token_logprobs(sequences)
    monkeypatch.setattr(heads, "HEAD_CHUNK_BYTES", 4 * 2 * 128 * 4)  # two positions of 4 rows per chunk
    assert heads._positions_per_chunk(4, 32, 128) == 2
    chunked = scorer_for(tmp_path, "float32", plan_with_completions(), kernels=Kernels()).token_logprobs(sequences)
    for a, b, sequence in zip(whole, chunked, sequences):
        assert_matches(b, torch_log_softmax(torch_model, sequence), sequence, atol=1e-4)
        np.testing.assert_allclose(a.next_logprobs, b.next_logprobs, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        assert a.next_id == b.next_id


def test_sampling_is_reproducible_and_follows_the_distribution(tmp_path):
    torch_model = tiny_checkpoint("qwen2", tmp_path)
    scorer = scorer_for(tmp_path, "float32", plan_with_completions())
    prompt = [5, 17, 99, 3, 42]
    probs = np.exp(torch_log_softmax(torch_model, prompt)[-1])
    draws = scorer.token_logprobs([prompt] * 400, [Sampling(temperature=1.0, seed=s) for s in range(400)])
    again = scorer.token_logprobs([prompt] * 3, [Sampling(temperature=1.0, seed=s) for s in range(3)])
    assert [d.next_id for d in draws[:3]] == [a.next_id for a in again]  # same seed, same token
    counts = np.bincount([d.next_id for d in draws], minlength=len(probs)) / len(draws)
    top = np.argsort(-probs)[:3]
    np.testing.assert_allclose(counts[top], probs[top], atol=0.08)  # 400 draws: 4 standard errors at p = 0.5
    for d in draws:  # the drawn token's log-probability is the model's, not the temperature's
        assert d.next_logprob == pytest.approx(np.log(probs[d.next_id]), abs=1e-4)
    greedy = scorer.token_logprobs([prompt], [Sampling(temperature=0.0, seed=123)])[0]
    assert greedy.next_id == int(np.argmax(probs))


@pytest.mark.slow
def test_the_embedded_model_matches_transformers(embedded_dir, torch_embedded):
    model, tokenizer = torch_embedded
    scorer = scorer_for(embedded_dir, "float32", plan_with_completions(lengths=(32, 64)))
    texts = ["The capital of France is Paris, and the capital of Germany is Berlin.",
             "def add(a, b):\n    return a + b", "Once upon a time there was a fisherman"]
    sequences = [tokenizer.encode(text) for text in texts]
    for ours, sequence in zip(scorer.token_logprobs(sequences), sequences):
        assert_matches(ours, torch_log_softmax(model, sequence), sequence, atol=1e-3)


@pytest.mark.parametrize("vocab", [100, 1_000, 49_152, 151_936])
def test_grouped_top_k_is_lax_top_k(vocab):
    """The per-position top alternatives' two-pass top_k returns lax.top_k's values and ids, ties included (the
    lowest id first): on random logits and on coarse ones where many entries tie."""
    import jax
    import jax.numpy as jnp

    from runtime.model.heads import TOP_K, _top_k

    rng = np.random.default_rng(vocab)
    for logits in (rng.normal(size=(6, vocab)), np.round(rng.normal(size=(6, vocab)) * 2)):
        x = jnp.asarray(logits, jnp.float32)
        values, ids = jax.jit(lambda a: _top_k(a, TOP_K))(x)
        expected_values, expected_ids = jax.lax.top_k(x, TOP_K)
        assert np.array_equal(values, expected_values) and np.array_equal(ids, expected_ids)


# Prompts longer than a block of the prefix cache's keys: one kept whole (a context bucket of 96), answers after it.
PROMPT_CACHE_PLAN = dataclasses.replace(
    small_plan(lengths=(16, 96), batches=(1,), prefix_sharing=True, contexts=(96,), suffix_lengths=(8,)),
    completion_batches=(4,), kept_prompts=BLOCK)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompts_after_a_cached_one_give_the_bits_of_no_cache(case, tmp_path):
    """The prefix cache for prompts read at every position (runtime.requests.prefix_cache), on every family: a
    70-token question kept with its outputs, then two answers read after it in one device batch; every output equal to
    a scorer's without a cache. Families whose RoPE frequencies change with the length (past 24 tokens here) read
    every prompt whole."""
    family, overrides = CASES[case]
    tiny_checkpoint(family, tmp_path, **overrides)
    plain = scorer_for(tmp_path, "float32", PROMPT_CACHE_PLAN)
    cached = Scorer(PROMPT_CACHE_PLAN, plain.exe, 1, prefix_cache=PrefixCache(1 << 28))
    rng = np.random.default_rng(11)
    question = rng.integers(0, 128, 70).tolist()
    prompts = [question + [first] + rng.integers(0, 128, n).tolist() for first, n in ((1, 4), (2, 7), (3, 12))]
    held = []
    for batch in (prompts[:1], prompts[1:]):
        dispatched = cached.dispatch([TokenJob(batch, [Sampling()] * len(batch))])
        for ours, expected in zip(cached.collect(dispatched)[0], plain.token_logprobs(batch), strict=True):
            for field in ("next_logprobs", "top_ids", "top_logprobs"):
                assert np.array_equal(getattr(ours, field), getattr(expected, field)), field
            assert (ours.next_id, ours.next_logprob) == (expected.next_id, expected.next_logprob)
        held.append(dispatched.cached_tokens[0])
    assert held == ([0, 2 * 69] if plain.rope_length_limit is None else [0, 0])
