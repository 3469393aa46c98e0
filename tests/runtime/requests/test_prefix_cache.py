"""The prefix cache (runtime.requests.prefix_cache): its keys, isolation and byte bound; and through a scorer, that a
hit, a partial hit and a miss give the same bits (np.array_equal) as a scorer without a cache."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from runtime.requests.jobs import Job
from runtime.requests.prefix_cache import BLOCK, MIN_TOKENS, PrefixCache
from runtime.requests.scorer import Scorer
from tests.runtime.conftest import random_sequences, scorer_for, small_plan, tiny_checkpoint

VOCAB = 128
KV = (np.zeros((2, 256, 1, 4), np.float32), np.zeros((2, 256, 1, 4), np.float32))  # 16 KiB, a 256-token context
ENTRY_BYTES = sum(a.nbytes for a in KV)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def test_the_longest_cached_run_is_found_at_a_block_boundary_or_its_exact_length_then_through_its_tokens():
    cache = PrefixCache(10 * ENTRY_BYTES)
    prompt = tokens(0, 200)
    assert cache.insert(prompt, 200, KV, 256)
    assert cache.peek(prompt, 200) == 200  # the exact prefix, inside a block
    assert cache.peek(prompt + [1, 2], 202) == 200  # longer: all the entry holds
    other = prompt[:130] + tokens(1, 70)
    assert cache.peek(other, 200) == 130  # two whole blocks, then the entry's tokens as far as they agree
    assert cache.peek(other, 100) == 100  # never past the limit
    assert cache.peek(prompt[:60] + tokens(1, 140), 200) == 0  # not one whole block
    assert cache.peek(tokens(2, 200), 200) == 0
    hit = cache.lookup(other, 200)
    assert hit.length == 130 and hit.kv is KV and hit.context == 256
    assert cache.query_tokens == 200 and cache.hit_tokens == 130
    assert not cache.insert(prompt, 200, KV, 256)  # held once


def test_salts_and_adapters_never_share_blocks():
    cache = PrefixCache(10 * ENTRY_BYTES)
    prompt = tokens(0, 130)
    cache.insert(prompt, 130, KV, 256, adapter=0, salt="tenant a")
    assert cache.peek(prompt, 130, adapter=0, salt="tenant a") == 130
    assert cache.peek(prompt, 130, adapter=0, salt="tenant b") == 0
    assert cache.peek(prompt, 130, adapter=0, salt=None) == 0
    assert cache.peek(prompt, 130, adapter=1, salt="tenant a") == 0


def test_least_recently_used_entries_are_evicted_within_the_bound():
    cache = PrefixCache(3 * ENTRY_BYTES)
    prompts = [tokens(seed, 100) for seed in range(5)]
    for prompt in prompts[:3]:
        cache.insert(prompt, 100, KV, 256)
    cache.lookup(prompts[0], 100)  # recently used: kept
    for prompt in prompts[3:]:
        cache.insert(prompt, 100, KV, 256)
        assert cache.bytes <= cache.capacity_bytes
    assert [cache.peek(p, 100) for p in prompts] == [100, 0, 0, 100, 100]
    assert cache.evictions == 2 and cache.stats()["prefix_cache_entries"] == 3
    assert not PrefixCache(ENTRY_BYTES - 1).insert(prompts[0], 100, KV, 256)  # larger than the cache: not kept


# A plan whose contexts hold whole blocks: a one-sequence prompt of MIN_TOKENS or more is computed apart and kept.
LONG = small_plan(lengths=(64, 320), batches=(1, 4), prefix_sharing=True, contexts=(128, 256),
                  suffix_lengths=(8, 64), suffix_batches=(4,))


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    """(without a cache, with one) on one tiny llama's compiled programs."""
    model_dir = tmp_path_factory.mktemp("llama")
    tiny_checkpoint("llama", model_dir, max_position_embeddings=512)
    plain = scorer_for(model_dir, "float32", LONG)
    return plain, Scorer(LONG, plain.exe, 1, prefix_cache=PrefixCache(1 << 30))


def scored(scorer: Scorer, sequences, labels=(0, 5, 127), salt=None) -> tuple[np.ndarray, int]:
    dispatched = scorer.dispatch([Job(sequences, labels, cache_salt=salt)])
    return scorer.collect(dispatched)[0], dispatched.cached_tokens[0]


def test_a_prompt_computed_once_gives_its_bits_on_every_hit(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    prompt = tokens(3, 270)  # a few-shot prompt, then each request's own text
    texts = [prompt + tokens(10 + i, 20) for i in range(3)]
    first, hit = scored(cached, [texts[0]])
    assert hit == 0 and np.array_equal(first, plain.score([texts[0]], [0, 5, 127]))
    for text in texts[1:]:
        ours, hit = scored(cached, [text])
        assert hit == 4 * BLOCK >= MIN_TOKENS  # its whole blocks of the shared prompt
        assert np.array_equal(ours, plain.score([text], [0, 5, 127]))
    again, hit = scored(cached, [texts[0]])
    assert hit == 4 * BLOCK and np.array_equal(again, first)


def test_a_query_again_and_a_prompt_that_extends_it_inside_a_block(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    query = tokens(4, 200)
    items = random_sequences(np.random.default_rng(5), 4, 1, 8, VOCAB)
    sequences = [query + item for item in items]
    first, hit = scored(cached, sequences)
    second, hit_again = scored(cached, sequences)
    assert hit == 0 and hit_again == 200 * len(items)  # the whole query, which ends inside a block
    longer = [query + tokens(8, 10)]  # extends the cached query, which ends inside a block: all of it is read
    extended, partial = scored(cached, longer)
    assert partial == 200
    for ours, expected in ((first, sequences), (second, sequences), (extended, longer)):
        assert np.array_equal(ours, plain.score(expected, [0, 5, 127]))
    # evicted, then computed again: the same bits
    cached.prefix_cache.clear()
    assert np.array_equal(scored(cached, sequences)[0], first)


# LONG with a context bucket that holds a kept prefix and more: a cached context is extended within it.
EXTENDING = dataclasses.replace(LONG, context_lengths=(128, 320), kept_prompts=MIN_TOKENS)


@pytest.mark.parametrize("instruction_length", [256, 260])  # the cached part ends at a block boundary, or inside one
def test_a_query_past_a_cached_prompt_computes_its_rest_once_and_keeps_it(scorers, instruction_length):
    """A recommender pages members' profiles after one instruction: another member's request kept the instruction,
    so this member's query is computed past it (extend_context: the profile only) and kept, its items read the whole
    query, and its next page reads all of it from the cache; the bits of a scorer without a cache."""
    plain, _ = scorers
    cached = Scorer(EXTENDING, plain.exe, 1, prefix_cache=PrefixCache(1 << 30))
    instruction, (a, b) = tokens(30, instruction_length), (tokens(31, 20), tokens(32, 40))

    def page(member: list[int], seed: int) -> list[list[int]]:
        return [instruction + member + item for item in random_sequences(np.random.default_rng(seed), 6, 1, 8, VOCAB)]
    scored(cached, page(a, 0))  # the instruction and member a computed whole, and kept
    first = Job(page(b, 1), (0, 5, 127))
    assert cached.cost([first]).context == 64  # the profile's rest length, not the whole query's context
    dispatched = cached.dispatch([first])
    assert dispatched.buckets[0] == "extend_context[320, 64]" and dispatched.cached_tokens == [instruction_length * 6]
    assert np.array_equal(cached.collect(dispatched)[0], plain.score(page(b, 1), (0, 5, 127)))
    dispatched = cached.dispatch([Job(page(b, 2), (0, 5, 127))])
    assert dispatched.cached_tokens == [(instruction_length + 40) * 6]
    assert {name.split("[")[0] for name in dispatched.buckets} == {"hidden_after_context", "label_logprobs"}
    assert np.array_equal(cached.collect(dispatched)[0], plain.score(page(b, 2), (0, 5, 127)))
    assert ("extend_context", (320, 64)) in {(p.name, bucket) for p, bucket in EXTENDING.programs()}


def test_a_prompt_that_ends_inside_a_block_is_read_whole_once_a_request_kept_it_with_its_text(scorers):
    """A few-shot prompt, then each request's own text: the first request keeps all it can (prompt and text), and the
    next ones read the prompt up to its last token, where their texts part (not only its whole blocks)."""
    plain, cached = scorers
    cached.prefix_cache.clear()
    prompt = tokens(15, 200)
    texts = [prompt + tokens(60 + i, 60) for i in range(3)]
    first, hit = scored(cached, [texts[0]])
    assert hit == 0 and np.array_equal(first, plain.score([texts[0]], [0, 5, 127]))
    for text in texts[1:]:
        ours, hit = scored(cached, [text])
        assert hit == 200 and np.array_equal(ours, plain.score([text], [0, 5, 127]))


def test_another_salt_shares_nothing_and_gets_the_same_bits(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    text = tokens(6, 300)
    mine, _ = scored(cached, [text], salt="a")
    theirs, hit = scored(cached, [text], salt="b")
    assert hit == 0 and np.array_equal(mine, theirs)
    assert scored(cached, [text], salt="a")[1] == 4 * BLOCK


def test_admission_prices_a_hit_as_the_tokens_it_computes(scorers):
    _, cached = scorers
    cached.prefix_cache.clear()
    text = tokens(7, 300)
    before = cached.cost([Job([text], (0,))])
    scored(cached, [text])
    after = cached.cost([Job([text], (0,))])
    assert before.context > 0 and after.context == 0 and after.tokens < before.tokens


def test_requests_after_one_cached_prompt_share_its_device_batches(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    prompt = tokens(9, 280)
    texts = [prompt + tokens(20 + i, 12) for i in range(4)]
    scored(cached, [texts[0]])
    before = cached.prefix_batches
    dispatched = cached.dispatch([Job([text], (0, 5, 127)) for text in texts])
    results = cached.collect(dispatched)
    assert cached.prefix_batches - before == 1 and dispatched.cached_tokens == [4 * BLOCK] * 4  # one batch of four
    for text, ours in zip(texts, results):
        assert np.array_equal(ours, plain.score([text], [0, 5, 127]))


def test_requests_after_one_prompt_in_one_round_compute_it_once(scorers):
    """With a cache or without: requests of one round with one query (or prompt) compute it once, their items in
    common device batches, with each request's own bits."""
    for scorer in scorers:
        if scorer.prefix_cache is not None:
            scorer.prefix_cache.clear()
        query = tokens(13, 150)
        jobs = [Job([query + tokens(30 + i, 3), query + tokens(40 + i, 5)], (0, 5, 127)) for i in range(2)]
        assert scorer.cost(jobs).context == scorer.cost(jobs[:1]).context > 0  # one context computed
        before = scorer.prefix_batches
        results = scorer.collect(scorer.dispatch(jobs))
        assert scorer.prefix_batches - before == 1  # four items in one device batch of four
        for job, ours in zip(jobs, results):
            assert np.array_equal(ours, scorers[0].score(job.sequences, [0, 5, 127]))


def test_items_after_a_cached_prompt_pay_their_share_of_a_device_batch_on_a_busy_device(scorers):
    _, cached = scorers
    cached.prefix_cache.clear()
    prompt = tokens(14, 280)
    scored(cached, [prompt + tokens(50, 12)])
    job = Job([prompt + tokens(51, 12)], (0,))
    share, alone = cached.cost([job], marginal=True), cached.cost([job])
    assert share.batches == 1 / 4 and alone.batches == 1 and share.context == alone.context == 0


def test_requests_after_one_that_will_compute_their_prompt_are_priced_as_hits_on_a_busy_device(scorers):
    """A burst of requests with one prompt: the first computes it, the others are priced by what they add once it is
    cached (their share of a busy device); alone, each would compute it (its own work, what admission promises)."""
    _, cached = scorers
    cached.prefix_cache.clear()
    text = tokens(11, 300)
    other = [text[:290] + tokens(12, 10)]
    miss = cached.cost([Job(other, (0,))], marginal=True)
    cached.expect(Job([text], (0,)), time.monotonic() - 1)  # its deadline passed: not expected any more
    assert cached.cost([Job(other, (0,))], marginal=True) == miss
    cached.expect(Job([text], (0,)), time.monotonic() + 60)
    share, alone = cached.cost([Job(other, (0,))], marginal=True), cached.cost([Job(other, (0,))])
    assert share.context == 0 < miss.context and alone.context == miss.context
    scored(cached, [text])  # computed and kept: a hit either way
    assert cached.cost([Job(other, (0,))]).context == 0
