"""Issue 26's acceptance through real HTTP: with default settings on a CPU, the same probe requests give bitwise-equal
scores alone, reordered, inside larger requests and while other clients' requests of other shapes run, in float32
and bfloat16, on every scoring endpoint (a shared prefix included). The server runs the embedded model's shapes
(embedded_shaped_dir: its config, tokenizer and chat template, 2 of its 30 scanned layers): the same kernels and the
same batching, at a fifteenth of the compute; tests/runtime/model/test_parity_embedded.py judges the real weights."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess

pytestmark = pytest.mark.slow
VOCAB = 49152
LABELS = [7042, 4528, 11452, 0, VOCAB - 1]
LONG_QUERY = ("You are a careful judge. Read the passage about European capitals and answer with one word: which "
              "city is the capital of the country named at the end? The country is")  # > 32 tokens: a shared prefix
PROBES = [
    {"query": "The capital of France is", "items": ["", " Paris", " a city"]},
    {"query": LONG_QUERY, "items": [" France", " Germany", " Italy and", " Spain, answer:"]},
    {"query": [504, 3575, 282] * 12, "items": [[4649, 314], [11], [7042, 7042, 7042], [5, 6, 7, 8, 9, 10]]},
    {"query": "Rate the answer from 1 to 5. Answer: the sky is blue because of Rayleigh scattering. Rating:",
     "items": [" 1", " 5"], "item_first": True},
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def server(request, embedded_shaped_dir):
    # A wait budget no request here misses: these tests are about the scores' bits, not admission.
    # 128 tokens: the built-in reranker's template with a query and a document.
    env = {**SMALL_BUCKETS, "SCOREFN_LENGTH_BUCKETS": "32,64,128", "SCOREFN_DTYPE": request.param,
           "SCOREFN_MAX_WAIT_S": "600", "SCOREFN_MODEL": str(embedded_shaped_dir)}
    with ServerProcess(env=env) as process:
        yield process


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def scores(server, probe: dict) -> np.ndarray:
    return np.asarray(post(server, "/v1/score", {**probe, "label_token_ids": LABELS})["scores"], np.float32)


def other_traffic(server, count: int) -> list[dict]:
    """Requests of other shapes and sizes (each answered 200): what other clients send meanwhile."""
    rng = np.random.default_rng(7)
    bodies = []
    for n in range(count):
        items = [rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist() for _ in range(int(rng.integers(1, 12)))]
        bodies.append(("/v1/score", {"query": rng.integers(0, VOCAB, int(rng.integers(1, 34))).tolist(),
                                     "items": items, "label_token_ids": rng.integers(0, VOCAB, 3).tolist()}))
        if n % 3 == 0:
            bodies.append(("/v1/completions", {"prompt": "Once upon a time " * int(rng.integers(1, 5)),
                                               "max_tokens": 0, "echo": True, "logprobs": 2}))
    return bodies


def test_the_server_says_its_scores_are_batch_invariant(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["batch_invariant"] is True


def test_probes_score_the_same_bits_reordered_inside_larger_requests_and_under_load(server):
    alone = [scores(server, probe) for probe in PROBES]
    assert all(np.array_equal(scores(server, probe), expected) for probe, expected in zip(PROBES, alone))

    for probe, expected in zip(PROBES, alone):  # items reversed
        reversed_scores = scores(server, {**probe, "items": probe["items"][::-1]})[::-1]
        assert np.array_equal(reversed_scores, expected), probe["query"]

    rng = np.random.default_rng(3)
    for probe, expected in zip(PROBES, alone):  # inside a larger request: more items of other lengths around them
        text = isinstance(probe["items"][0], str)
        extra = [" and so on" * int(n) for n in rng.integers(1, 5, 9)] if text else \
            [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 20, 9)]
        larger = extra[:4] + probe["items"] + extra[4:]
        got = scores(server, {**probe, "items": larger})[4: 4 + len(probe["items"])]
        assert np.array_equal(got, expected), probe["query"]

    traffic = other_traffic(server, 24)
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:  # bounded: 24 + 8 requests at most
        background = [pool.submit(post, server, path, body) for path, body in traffic]
        under_load = [pool.submit(scores, server, probe) for probe in PROBES]
        for future, expected in zip(under_load, alone):
            assert np.array_equal(future.result(), expected)
        for future in background:
            future.result()


def test_rerank_classify_and_completions_are_the_same_bits_alone_and_together(server):
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris.",
                 "Berlin is in Germany, a country in Europe with many rivers and forests."]
    query = "Where is the Eiffel Tower?"

    def relevance(docs: list[str]) -> dict[str, float]:
        body = post(server, "/v1/rerank", {"query": query, "documents": docs})
        return {docs[result["index"]]: result["relevance_score"] for result in body["results"]}
    alone = {doc: relevance([doc])[doc] for doc in documents}
    assert relevance(documents) == alone
    assert relevance(documents[::-1]) == alone

    inputs = ["I loved this film.", "Terrible service, never again.", "It was fine, I guess, nothing special."]
    classify = {text: post(server, "/v1/classify", {"input": text})["data"][0]["probs"] for text in inputs}
    together = post(server, "/v1/classify", {"input": inputs[::-1]})["data"]
    assert [entry["probs"] for entry in together] == [classify[text] for text in inputs[::-1]]

    prompts = ["The capital of France is Paris.", "One two three four five six seven eight nine ten."]

    def echoed(batch: list[str]) -> list[dict]:
        body = post(server, "/v1/completions", {"prompt": batch, "max_tokens": 0, "echo": True, "logprobs": 3})
        return [choice["logprobs"] for choice in body["choices"]]
    single = [echoed([prompt])[0] for prompt in prompts]
    assert echoed(prompts) == single
    assert echoed(prompts[::-1]) == single[::-1]
