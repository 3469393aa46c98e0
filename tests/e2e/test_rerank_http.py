"""/v1/rerank through real HTTP on the embedded model's built-in reranker: Cohere's Python SDK (ClientV2, which
calls /v2/rerank) and a request in the Jina / vLLM shape."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

# Short texts: the e2e server's longest sequence is 64 tokens, template included.
QUERY = "Capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "Dogs bark loudly."]
RELEVANT = 1


def test_cohere_client_v2_reranks_in_order(server):
    cohere = pytest.importorskip("cohere")
    with cohere.ClientV2(api_key="unused", base_url=server.url) as co:  # closed: no stray socket
        response = co.rerank(model="relevance", query=QUERY, documents=DOCUMENTS, top_n=2)
        assert [r.index for r in response.results][0] == RELEVANT and len(response.results) == 2
        scores = [r.relevance_score for r in response.results]
        assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)
        assert response.id.startswith("rerank-")
        everything = co.rerank(model="relevance", query=QUERY, documents=DOCUMENTS)
        assert sorted(r.index for r in everything.results) == [0, 1, 2]
        assert [(r.index, r.relevance_score) for r in everything.results][:2] == [
            (r.index, r.relevance_score) for r in response.results]
        with pytest.raises(cohere.BadRequestError) as caught:
            co.rerank(model="relevance", query="  ", documents=DOCUMENTS)
        assert caught.value.body["error"]["code"] == "empty_query"
        with pytest.raises(cohere.BadRequestError) as caught:
            co.rerank(model="rerank-v3.5", query=QUERY, documents=DOCUMENTS)
        assert caught.value.body["error"]["code"] == "model_not_found"


def test_jina_and_vllm_shape(server):
    body = {"model": "relevance", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 3,
            "return_documents": True}
    response = httpx.post(server.url + "/v1/rerank", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert set(result) == {"id", "model", "results", "usage"} and result["model"] == "relevance"
    assert result["results"][0]["index"] == RELEVANT
    assert [r["document"]["text"] for r in result["results"]] == [DOCUMENTS[r["index"]] for r in result["results"]]
    scores = [r["relevance_score"] for r in result["results"]]
    assert scores == sorted(scores, reverse=True)
    assert result["usage"]["prompt_tokens"] == result["usage"]["total_tokens"] > 0
    assert {"x-request-id", "x-device-time"} <= set(response.headers)

    plain = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert [(r["index"], r["relevance_score"]) for r in plain["results"]] == [
        (r["index"], r["relevance_score"]) for r in result["results"]]  # the same scores: a string is its text
    error = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": [], "top_n": 0}, timeout=60)
    assert error.status_code == 400 and error.json()["error"]["code"] == "empty_documents"
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert {"id": "relevance", "task": "rerank", "parent": "SmolLM2-135M-Instruct"}.items() <= models[-1].items()
