"""The prefix cache for prompts read at every position (/v1/completions' echo, lm-evaluation-harness's
log-likelihoods): a prompt kept with its per-position outputs, then prompts that share its leading tokens read only
their rest after it; every output has the bits of a scorer without a cache (np.array_equal), and hits compile
nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.interface import Sampling
from runtime.requests.cost import Work, plan_work
from runtime.requests.jobs import Job, TokenJob
from runtime.requests.prefix_cache import BLOCK, MIN_TOKENS, PrefixCache
from runtime.requests.scorer import Scorer
from tests.runtime.conftest import scorer_for, small_plan, tiny_checkpoint

VOCAB = 128
PLAN = dataclasses.replace(small_plan(lengths=(16, 64, 320), batches=(1, 4), prefix_sharing=True, contexts=(128, 320),
                                      suffix_lengths=(8, 64), suffix_batches=(4,), completion_batches=(1, 4)),
                           kept_prompts=MIN_TOKENS)


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    """(without a cache, with one) on one tiny llama's compiled programs."""
    model_dir = tmp_path_factory.mktemp("llama")
    tiny_checkpoint("llama", model_dir, max_position_embeddings=512)
    plain = scorer_for(model_dir, "float32", PLAN)
    return plain, Scorer(PLAN, plain.exe, plain.launcher.threads, prefix_cache=PrefixCache(1 << 30))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def read(scorer: Scorer, prompts, salt=None, sampling=None):
    """Each prompt's TokenLogprobs, and the tokens the cache held."""
    job = TokenJob(prompts, sampling or [Sampling()] * len(prompts), cache_salt=salt)
    dispatched = scorer.dispatch([job])
    return scorer.collect(dispatched)[0], dispatched.cached_tokens[0]


def assert_same_bits(ours, theirs) -> None:
    for mine, expected in zip(ours, theirs, strict=True):
        for field in ("next_logprobs", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(mine, field), getattr(expected, field)), field
        assert (mine.next_id, mine.next_logprob) == (expected.next_id, expected.next_logprob)


def test_a_question_kept_once_gives_every_answer_the_bits_of_a_miss(scorers):
    """lm-evaluation-harness's multiple choice: one prompt per answer, the question repeated. The first is read whole
    and kept; each next one reads its answer (and the question's last token) after the cached question."""
    plain, cached = scorers
    cached.prefix_cache.clear()
    question = tokens(1, 270)
    prompts = [question + tokens(10 + i, 5 + 3 * i) for i in range(4)]
    first, held = read(cached, prompts[:1])
    assert held == 0 and len(prompts[0]) >= MIN_TOKENS
    assert_same_bits(first, plain.token_logprobs(prompts[:1]))
    for prompt in prompts[1:]:
        ours, held = read(cached, [prompt])
        assert held == len(question) - 1  # the question up to its last token, which is read again
        assert_same_bits(ours, plain.token_logprobs([prompt]))
    job = TokenJob(prompts[1:], [Sampling()] * 3)  # several answers in one request: one device batch after it
    dispatched = cached.dispatch([job])
    assert dispatched.cached_tokens[0] == 3 * (len(question) - 1)
    assert_same_bits(cached.collect(dispatched)[0], plain.token_logprobs(prompts[1:]))
    assert dispatched.buckets == ["token_logprobs_after_context[320, 4, 16]"]
    # what a hit runs is compiled at start with the rest (no request compiles)
    assert ("token_logprobs_after_context", (320, 4, 16)) in {(p.name, b) for p, b in PLAN.programs()}


def test_answers_to_one_question_in_one_request_compute_it_once(scorers):
    """lm-evaluation-harness with batch_size above 1: a question's answers in one request, none cached. The first is
    read whole and kept; the others read their rest after it in the same round (one device batch), with the bits of
    a miss; nothing came from the cache. Another salt in the same round shares nothing."""
    plain, cached = scorers
    cached.prefix_cache.clear()
    question = tokens(11, 275)
    prompts = [question + tokens(20 + i, 4 + 2 * i) for i in range(4)]
    job = TokenJob(prompts, [Sampling()] * 4)
    priced = cached.cost([job])
    dispatched = cached.dispatch([job, TokenJob(prompts[1:2], [Sampling()], cache_salt="tenant b")])
    assert dispatched.cached_tokens == [0, 0]
    ours, theirs = cached.collect(dispatched)
    assert_same_bits(ours, plain.token_logprobs(prompts))
    assert_same_bits(theirs, plain.token_logprobs(prompts[1:2]))
    assert dispatched.buckets == ["token_logprobs_context[320]", "token_logprobs_after_context[320, 4, 16]",
                                  "token_logprobs_context[320]"]
    assert priced == Work(batches=2, completion=320 + 4 * 16)  # admission prices the round as it runs
    assert read(cached, [prompts[2]])[1] == len(question) - 1  # the first answer's prompt was kept


def test_the_same_prompt_again_and_one_that_parts_inside_a_block(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    prompt = tokens(2, 300)
    first, _ = read(cached, [prompt])
    again, held = read(cached, [prompt])
    assert held == len(prompt) - 1
    assert_same_bits(again, first)
    agree = 2 * BLOCK + 17  # agrees with the kept prompt past two whole blocks, then parts
    parted = prompt[:agree] + [(prompt[agree] + 1) % VOCAB] + tokens(3, 20)
    ours, held = read(cached, [parted])
    assert held == agree - 1
    assert_same_bits(ours, plain.token_logprobs([parted]))
    sampled = [Sampling(temperature=0.8, seed=7)]  # a drawn next token: the same draw
    assert_same_bits(read(cached, [parted], sampling=sampled)[0], plain.token_logprobs([parted], sampled))
    cached.prefix_cache.clear()  # evicted, then computed again: the same bits
    assert_same_bits(read(cached, [prompt])[0], first)


def test_another_salt_shares_nothing_and_gets_the_same_bits(scorers):
    plain, cached = scorers
    cached.prefix_cache.clear()
    question = tokens(4, 280)
    read(cached, [question + [5, 6]], salt="tenant a")
    ours, held = read(cached, [question + [7]], salt="tenant b")
    assert held == 0
    assert_same_bits(ours, plain.token_logprobs([question + [7]]))
    assert read(cached, [question + [7]], salt="tenant a")[1] == len(question) - 1


def test_a_kept_prompt_serves_scores_and_a_scored_context_does_not_serve_prompts(scorers):
    """A prompt read at every position keeps the keys and values a score request reads; a context kept by a score
    request has no per-position outputs, so a prompt read at every position computes its own (and then keeps it)."""
    plain, cached = scorers
    cached.prefix_cache.clear()
    question = tokens(5, 290)
    read(cached, [question])
    text = question + tokens(6, 10)
    dispatched = cached.dispatch([Job([text], [0, 5, 127])])
    assert dispatched.cached_tokens[0] == len(question)
    assert np.array_equal(cached.collect(dispatched)[0], plain.score([text], [0, 5, 127]))
    cached.prefix_cache.clear()
    cached.score([tokens(7, 280) + tokens(8, 10)], [0])  # kept for scoring only
    prompt = tokens(7, 280) + [9]
    ours, held = read(cached, [prompt])
    assert held == 0
    assert_same_bits(ours, plain.token_logprobs([prompt]))
    assert read(cached, [prompt])[1] == len(prompt) - 1  # kept now, with its outputs


def test_admission_prices_a_hit_as_the_tokens_it_computes(scorers):
    _, cached = scorers
    cached.prefix_cache.clear()
    question = tokens(9, 300)
    job = TokenJob([question + [1, 2, 3]], [Sampling()])
    miss = cached.cost([job])
    read(cached, [question])
    hit = cached.cost([job])
    assert hit.completion < miss.completion / 4 and hit == plan_work(PLAN, [job], None, False, None,
                                                                      cached.held_prompt())


def test_the_embedded_model_in_the_hosts_format_gives_a_miss_s_bits_on_every_hit(embedded_dir):
    """The embedded SmolLM2-135M in this host's format (bfloat16 where it multiplies bfloat16, else float32): a
    290-token question kept, three answers read after it in one device batch, every output equal to a scorer's
    without a cache."""
    from runtime.assembly.platform import host_cpu_format

    plan = dataclasses.replace(PLAN, lengths=(24, 320), context_lengths=(320,), kept_prompts=MIN_TOKENS)
    plain = scorer_for(embedded_dir, host_cpu_format().dtype, plan)
    cached = Scorer(plan, plain.exe, plain.launcher.threads, prefix_cache=PrefixCache(1 << 30))
    rng = np.random.default_rng(12)
    question = rng.integers(100, 49000, 290).tolist()
    prompts = [question + [first] + rng.integers(100, 49000, n).tolist() for first, n in ((11, 1), (12, 4), (13, 9))]
    first, held = read(cached, prompts[:1])
    assert held == 0
    assert_same_bits(first, plain.token_logprobs(prompts[:1]))
    answers, held = read(cached, prompts[1:])
    assert held == 2 * (len(question) - 1)  # the question but its last token, which each reads with its answer
    assert_same_bits(answers, plain.token_logprobs(prompts[1:]))
