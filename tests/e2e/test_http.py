"""End to end through real HTTP on the embedded model, against transformers' PyTorch reference."""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
import numpy as np
import pytest

from tests.conftest import torch_label_logprobs

pytestmark = pytest.mark.slow
PARIS, LONDON, BERLIN = 7042, 4528, 11452
VOCAB = 49152


def score(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/score", json=body, timeout=60)


def scores(server, **body) -> np.ndarray:
    response = score(server, **body)
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["scores"])


def test_text_mode_matches_transformers(server, torch_embedded):
    model, tokenizer = torch_embedded
    query, items = "The capital of", [" France is", " Germany is", " Italy is", ""]
    labels = [PARIS, LONDON, BERLIN, 0, VOCAB - 1]
    got = scores(server, query=query, items=items, label_token_ids=labels)
    expected = torch_label_logprobs(model, [tokenizer.encode(query + item) for item in items], labels)
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)
    probs = scores(server, query=query, items=items, label_token_ids=labels, apply_softmax=True)
    reference = np.exp(expected) / np.exp(expected).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(probs, reference, atol=0.01, rtol=0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)


def test_response_shape_usage_and_timing_headers(server):
    response = score(server, query="The capital of France is", items=["", " Paris"], label_token_ids=[PARIS])
    body = response.json()
    assert body["object"] == "scoring" and body["id"].startswith("score-") and body["model"]
    assert body["usage"] == {"prompt_tokens": 5 + 6, "completion_tokens": 0, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}}
    for header in ("x-request-id", "x-queue-time", "x-device-time", "x-total-time"):
        assert header in response.headers
    assert scores(server, query="The capital of France is", items=[""], label_token_ids=[PARIS])[0][0] == \
        pytest.approx(-0.258, abs=1e-3)


def test_a_repeated_query_is_read_from_the_prefix_cache_with_the_same_bits(server):
    """The same query and items twice: the second reads the query's keys and values from the prefix cache
    (runtime.requests.prefix_cache) and gives the same bits; another cache_salt shares nothing."""
    salt = uuid.uuid4().hex
    # A 29-token query, 8 items 5-7 tokens long: after it, each row fits the smallest item bucket, where in full each
    # pads to 64 tokens, so the query is computed once (and kept) whatever a device batch's measured price; and 8
    # items are one item batch, so the request is never split into slices (a second slice would read the first's)
    query = "Which of these is the capital city of France? Think of the map of Europe, then answer with the name of " \
            "one city only. Answer:"
    cities = ("Paris", "Lyon", "Nice", "Lille", "Metz", "Brest", "Caen", "Dijon")
    body = dict(query=query, items=[f" {city} (a city)" for city in cities], label_token_ids=[PARIS, LONDON],
                cache_salt=salt)
    first, second = (score(server, **body).json() for _ in range(2))
    other = score(server, **{**body, "cache_salt": salt + "-other"}).json()
    query_tokens = len(httpx.post(server.url + "/v1/tokenize", json={"text": query}).json()["tokens"])
    held = [reply["usage"]["prompt_tokens_details"]["cached_tokens"] for reply in (first, second, other)]
    assert held == [0, query_tokens * len(body["items"]), 0]
    assert first["scores"] == second["scores"] == other["scores"]


def test_token_mode_equals_text_mode(server):
    query = httpx.post(server.url + "/v1/tokenize", json={"text": "The capital of France is"}).json()["tokens"]
    item = httpx.post(server.url + "/v1/tokenize", json={"text": " a"}).json()["tokens"]
    by_tokens = scores(server, query=query, items=[item, []], label_token_ids=[PARIS, LONDON])
    by_text = scores(server, query="The capital of France is", items=[" a", ""], label_token_ids=[PARIS, LONDON])
    np.testing.assert_allclose(by_tokens, by_text, atol=1e-5)


def test_item_first_reverses_the_concatenation(server, torch_embedded):
    model, tokenizer = torch_embedded
    got = scores(server, query=" is a city", items=["Paris", "Tokyo"], label_token_ids=[13, 30], item_first=True)
    expected = torch_label_logprobs(model, [tokenizer.encode(t) for t in ("Paris is a city", "Tokyo is a city")],
                                    [13, 30])
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_duplicate_labels_edge_ids_unicode_and_many_labels(server):
    got = scores(server, query="naïve café 東京 🙂 <|im_start|> \"quotes\" \\ ", items=[""],
                 label_token_ids=[PARIS, PARIS, 0, VOCAB - 1])
    assert got[0][0] == got[0][1]
    assert np.all(np.isfinite(got)) and np.all(got <= 0)
    fifty = list(range(100, 150))
    many = scores(server, query="Pick a number:", items=[" 1", " 2"], label_token_ids=fifty)
    assert many.shape == (2, 50)
    assert np.all(np.exp(many).sum(axis=1) < 1.0)


def test_concurrent_requests_each_get_their_own_scores(server):
    queries = [f"Item number {i} is" for i in range(16)]
    alone = [scores(server, query=q, items=["", " big"], label_token_ids=[PARIS, i + 10])
             for i, q in enumerate(queries)]
    def send(i: int) -> httpx.Response:
        return score(server, query=queries[i], items=["", " big"], label_token_ids=[PARIS, i + 10])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        burst = list(pool.map(send, range(16)))
    assert sum(r.status_code == 200 for r in burst) >= 2, [r.status_code for r in burst]
    together = []
    for i, response in enumerate(burst):
        if response.status_code == 429:  # admission refused part of the burst: sent again, now that it is answered
            assert response.json()["error"]["code"] == "rate_limit_exceeded" and response.headers["retry-after"]
            response = send(i)
        assert response.status_code == 200, response.text
        together.append(np.asarray(response.json()["scores"]))
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_errors_come_in_the_envelope(server):
    response = score(server, query="x", items=[], label_token_ids=[1])
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "empty_items"
    response = score(server, query="x", items=[""], label_token_ids=[VOCAB])
    assert response.status_code == 422
    assert str(VOCAB) in response.json()["error"]["message"]
    response = score(server, query="word " * 100, items=[""], label_token_ids=[1])
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    body = {"query": "The capital of France is", "items": [""], "label_token_ids": [PARIS, LONDON]}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:  # closed: no stray socket
        result = client.post("/score", body=body, cast_to=object)
        assert result["scores"][0][0] == pytest.approx(-0.258, abs=1e-3)
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/score", body={**body, "items": []}, cast_to=object)
    assert caught.value.code == "empty_items"


def test_models_ready_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server.url + "/ready").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "scorefn_engine_queue_depth" in metrics
