"""The prefix cache under a stream of distinct long prompts, through real HTTP (issue 67's soak): 500 requests of
1,000-token prompts, each kept and, once the cache is full, each evicting the least recently used. The cache's bytes
never go above SCOREFN_PREFIX_CACHE_BYTES, evictions are counted, the server's memory stays flat once the cache is
full, and every answer has the bits of a server with the cache off; the first prompt, evicted long since, gives its
bits again, and the last, still held, is read from the cache with the same bits. Then lm-evaluation-harness's
multiple choice through /v1/completions (echo): each answer after its question read from the cache, with the bits of
the server with the cache off.

A tiny Llama with SmolLM2's tokenizer: the cache's bookkeeping, memory and bits are what is shown, at a fraction of
the embedded model's cost (its hits' bits on the real model: test_http.py)."""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import numpy as np
import pytest

from loadtests.rss import RssSampler
from runtime.tools.serverproc import ServerProcess
from tests.runtime.conftest import tiny_served

pytestmark = pytest.mark.slow
REQUESTS = 500
PROMPT_TOKENS = 1000
HELD = 16  # entries the cache has room for
CONTEXT = 1024  # the context bucket a 1,000-token prompt, kept whole (all before the item's read), fills
SOAK = {"SCOREFN_DTYPE": "float32", "SCOREFN_LENGTH_BUCKETS": f"32,{CONTEXT}", "SCOREFN_BATCH_BUCKETS": "1,4",
        "SCOREFN_CONTEXT_BUCKETS": str(CONTEXT), "SCOREFN_SUFFIX_LENGTH_BUCKETS": "64",
        "SCOREFN_SUFFIX_BATCH_BUCKETS": "4", "SCOREFN_MAX_LABELS": "4", "SCOREFN_MAX_WAIT_S": "600"}


@pytest.fixture(scope="module")
def model(tmp_path_factory, embedded_dir):
    directory = tmp_path_factory.mktemp("tiny-long")
    tiny_served("llama", directory, embedded_dir, max_position_embeddings=2 * CONTEXT)
    return directory


def entry_bytes(model) -> int:
    """An entry's keys and values: [layers, context bucket, kv heads, head dim] float32, twice."""
    cfg = json.loads((model / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * CONTEXT * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def prompts() -> list[list[int]]:
    rng = random.Random(67)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_TOKENS)] for _ in range(REQUESTS)]


def score(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    response = client.post(url + "/v1/score", json={"query": prompt, "items": [[prompt[0]]],
                                                     "label_token_ids": [7042, 4528]}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    values = {}
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("scorefn_prefix_cache_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def servers(model):
    """(a server with a cache of HELD entries, one with the cache off), started together."""
    cached = ServerProcess(env={**SOAK, "SCOREFN_MODEL": str(model),
                                "SCOREFN_PREFIX_CACHE_BYTES": str(HELD * entry_bytes(model))})
    with cached, ServerProcess(env={**SOAK, "SCOREFN_MODEL": str(model), "SCOREFN_PREFIX_CACHE_BYTES": "0"}) as off:
        yield cached, off


def test_distinct_long_prompts_keep_the_cache_within_its_bytes_and_memory_flat_with_the_bits_of_no_cache(model,
                                                                                                        servers):
    capacity = HELD * entry_bytes(model)
    sent = prompts()
    answers, rss = [], []
    server, off = servers
    with httpx.Client() as client:
        memory = RssSampler(server.proc.pid, interval=0)  # read by hand, after every tenth request
        for i, prompt in enumerate(sent):
            answers.append(score(client, server.url, prompt))
            held = metrics(client, server.url)
            assert held["scorefn_prefix_cache_bytes"] <= capacity, i
            assert held["scorefn_prefix_cache_bytes"] == min(i + 1, HELD) * entry_bytes(model), i
            if i % 10 == 9:
                rss.append(memory.rss_mb())
        evictions = metrics(client, server.url)["scorefn_prefix_cache_evictions_total"]
        again_first, again_last = score(client, server.url, sent[0]), score(client, server.url, sent[-1])
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0] * REQUESTS
    assert evictions == REQUESTS - HELD
    # Flat once full: over the second half, less growth than a quarter of what keeping each evicted entry would add.
    half = rss[len(rss) // 2:]
    leak_mb = (REQUESTS // 2) * entry_bytes(model) / 2**20
    assert half[-1] - half[0] < leak_mb / 4, (rss, leak_mb)
    assert again_first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # evicted: computed afresh
    assert again_last["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_TOKENS  # all before its read
    assert again_first["scores"] == answers[0]["scores"] and again_last["scores"] == answers[-1]["scores"]

    # Four at a time: rows of several requests share device batches, whose bits are each row's alone (batch-invariant).
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        uncached = list(pool.map(lambda prompt: score(client, off.url, prompt), sent))
    for i, (got, expected) in enumerate(zip(answers, uncached)):
        assert np.array_equal(np.asarray(got["scores"]), np.asarray(expected["scores"])), i


def completion(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    """lm-evaluation-harness's `local-completions` log-likelihood request: the prompt echoed with its tokens'
    log-probabilities and top alternatives, and the token after it."""
    response = client.post(url + "/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 5,
                                                          "max_tokens": 1, "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_multiple_choice_answers_read_their_question_from_the_cache_with_the_bits_of_no_cache(servers):
    """A 300-token question and four answers, a prompt each: the first is read whole and kept with its per-position
    log-probabilities; the others compute their answer (and the question's last token) after it."""
    rng = random.Random(68)
    question = [rng.randrange(100, 49000) for _ in range(300)]
    prompts = [question + [rng.randrange(100, 49000) for _ in range(n)] for n in (2, 4, 7, 12)]
    server, off = servers
    with httpx.Client() as client:
        ours = [completion(client, server.url, prompt) for prompt in prompts]
        again = completion(client, server.url, prompts[0])
        theirs = [completion(client, off.url, prompt) for prompt in prompts]
    held = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in (*ours, again)]
    assert held == [0] + [len(question) - 1] * 3 + [len(prompts[0]) - 1]
    assert [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in theirs] == [0] * 4
    for got, expected in zip([*ours, again], [*theirs, theirs[0]]):
        assert got["choices"] == expected["choices"]  # every log-probability and alternative, as JSON's floats
