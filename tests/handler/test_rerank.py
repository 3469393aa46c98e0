"""POST /v1/rerank (/v2/rerank, /rerank) on both faces with the fake engine: the Cohere / Jina / vLLM shape, every
error, both kinds of reranker."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from handler.core import ScoringCore
from handler.errors import ERRORS
from tests.handler.clients import Client
from tests.handler.conftest import assert_error, make_settings, serve
from tests.handler.fake_engine import FakeEngine
from tests.handler.fake_rerankers import (HEAD, NO, RELEVANCE, YES, RerankEngine, head_engine, pair_tokens,
                                          relevance_of)
from tests.handler.test_properties import PROPERTY_SETTINGS, assert_ok_or_enveloped_client_error, call, json_values

PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
QUERY = "q?"
# Relevance grows with the "*" count; documents 0 and 4, and 1 and 3, are exact ties (same count and length).
DOCUMENTS = ["plain", "one *", "two **", "uno *", "empty"]


@pytest.fixture
def engine() -> FakeEngine:
    return RerankEngine()


@pytest.fixture
def client(face: str, engine: FakeEngine) -> Iterator[Client]:
    with serve(face, make_settings(), engine) as c:
        yield c


def rerank(client: Client, path: str = "/v1/rerank", **body: Any) -> dict:
    reply = client.post(path, json={"query": QUERY, "documents": DOCUMENTS, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def test_response_has_the_vllm_and_cohere_shape(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert reply.status == 200
    body = reply.json()
    assert set(body) == {"id", "model", "results", "usage"}
    assert body["id"].startswith("rerank-") and len(body["id"]) == len("rerank-") + 32
    assert body["model"] == "relevance"
    pairs = [pair_tokens(RELEVANCE, QUERY, document) for document in DOCUMENTS]
    assert engine.submissions[-1][:2] == (pairs, [YES, NO])  # one pair per document, the yes/no tokens
    n = sum(map(len, pairs))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
    # by relevance descending, ties (documents 1 and 3, and 0 and 4) by index
    assert [result["index"] for result in body["results"]] == [2, 1, 3, 0, 4]
    for result in body["results"]:
        assert set(result) == {"index", "relevance_score", "document"}
        document = DOCUMENTS[result["index"]]
        assert result["document"] == {"text": document}
        assert result["relevance_score"] == pytest.approx(relevance_of(RELEVANCE.render(QUERY, document)), abs=1e-6)
    assert {"x-request-id", "x-queue-time", "x-device-time", "x-total-time"} <= set(reply.headers)


def test_every_path_answers_the_same(client: Client) -> None:
    bodies = [rerank(client, path, top_n=3) for path in PATHS]
    assert [{k: v for k, v in body.items() if k != "id"} for body in bodies] == [
        {k: v for k, v in bodies[0].items() if k != "id"}] * 3


def test_top_n_and_return_documents(client: Client) -> None:
    assert [r["index"] for r in rerank(client, top_n=2)["results"]] == [2, 1]
    assert len(rerank(client, top_n=1000)["results"]) == len(DOCUMENTS)  # more than there are: all of them
    assert len(rerank(client, top_n=None)["results"]) == len(DOCUMENTS)
    results = rerank(client, return_documents=False, top_n=3)["results"]
    assert [set(r) for r in results] == [{"index", "relevance_score"}] * 3
    assert rerank(client, return_documents=None)["results"][0]["document"] == {"text": "two **"}  # default: true


def test_documents_as_objects(client: Client, engine: FakeEngine) -> None:
    documents = [{"text": "a *"}, "b", {"text": "c **", "title": "ignored", "meta": [1]}]
    body = rerank(client, documents=documents)
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(2, "c **"), (0, "a *"), (1, "b")]
    assert engine.submissions[-1][0] == [pair_tokens(RELEVANCE, QUERY, d) for d in ("a *", "b", "c **")]


def test_empty_documents_are_ranked(client: Client) -> None:
    body = rerank(client, documents=["", " ", "*"])
    assert body["results"][0]["index"] == 2 and {r["index"] for r in body["results"][1:]} == {0, 1}


def test_max_tokens_per_doc_cuts_each_document(client: Client, engine: FakeEngine) -> None:
    documents = ["abcdef **", "xy", "z" * 100]  # the last pair is beyond the 64-token limit unless cut
    assert_error(client.post("/v1/rerank", json={"query": QUERY, "documents": documents}), 400,
                 "context_length_exceeded", "documents")
    body = rerank(client, documents=documents, max_tokens_per_doc=3)
    assert engine.submissions[-1][0] == [pair_tokens(RELEVANCE, QUERY, d) for d in ("abc", "xy", "zzz")]
    assert body["usage"]["prompt_tokens"] == sum(len(pair_tokens(RELEVANCE, QUERY, d)) for d in ("abc", "xy", "zzz"))
    assert {r["document"]["text"] for r in body["results"]} == set(documents)  # returned as given
    for result in body["results"]:  # the cut "**" no longer counts
        assert result["relevance_score"] == pytest.approx(relevance_of(""), abs=1e-6)


def test_context_length_is_checked_per_pair(client: Client) -> None:
    room = 64 - len(pair_tokens(RELEVANCE, QUERY, ""))
    assert rerank(client, documents=["z" * room])["usage"]["prompt_tokens"] == 64
    error = assert_error(client.post("/v1/rerank", json={"query": QUERY, "documents": ["a", "z" * (room + 1)]}),
                         400, "context_length_exceeded", "documents")
    assert "documents[1]" in error["message"] and "65" in error["message"] and "64" in error["message"]
    assert "max_tokens_per_doc" in error["message"]


def test_model_selects_the_reranker(client: Client, engine: FakeEngine) -> None:
    terse = rerank(client, model="terse")
    assert terse["model"] == "terse" and engine.submissions[-1][1] == [NO, YES]
    assert [r["index"] for r in terse["results"]] == [0, 4, 1, 3, 2]  # its yes/no are swapped: the order reverses
    assert rerank(client, model=None)["model"] == "relevance"  # the first reranker
    assert rerank(client, model="fake-model")["model"] == "relevance"  # the served model's id
    error = assert_error(client.post("/v1/rerank", json={"query": "q", "documents": ["d"], "model": "rerank-v3.5"}),
                         400, "model_not_found", "model")
    assert "['relevance', 'terse']" in error["message"]


def test_models_lists_the_rerankers(client: Client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [card["id"] for card in data] == ["fake-model", "relevance", "terse"]
    assert data[1] == {"id": "relevance", "object": "model", "created": data[0]["created"], "owned_by": "scorefn",
                       "parent": "fake-model", "task": "rerank"}


def test_both_faces_answer_the_same() -> None:
    bodies = []
    for face in ("asgi", "wsgi"):
        with serve(face, make_settings(), RerankEngine()) as client:
            body = rerank(client, "/v2/rerank", top_n=4, max_tokens_per_doc=4, model="terse")
            bodies.append({k: v for k, v in body.items() if k != "id"})
    assert bodies[0] == bodies[1]


# ---- a one-label sequence-classification model ------------------------------------------------------------

@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_classification_head_is_a_reranker(face: str) -> None:
    engine = head_engine()
    with serve(face, make_settings(), engine) as client:
        body = rerank(client, documents=["long document", "short", "mid size"])
        assert body["model"] == "fake-model"
        pairs = [pair_tokens(HEAD, QUERY, d) for d in ("long document", "short", "mid size")]
        assert engine.submissions[-1][:2] == (pairs, [0])  # the pair as is, the head's one logit
        # the fake logit is -0.01 * length: the shortest pair is the most relevant, sigmoid(logit)
        assert [r["index"] for r in body["results"]] == [1, 2, 0]
        for result in body["results"]:
            n = len(pairs[result["index"]])
            assert result["relevance_score"] == pytest.approx(1 / (1 + math.exp(0.01 * n)), abs=1e-6)
        (card,) = client.get("/v1/models").json()["data"]
        assert card["id"] == "fake-model" and card["task"] == "rerank" and "parent" not in card


def test_no_reranker_is_a_clear_400(face: str) -> None:
    with serve(face, make_settings(), FakeEngine()) as client:
        error = assert_error(client.post("/v1/rerank", json={"query": "q", "documents": ["d"]}), 400,
                             "model_not_supported", None, "model_error")
        assert "SCOREFN_RERANKERS" in error["message"]


# ---- errors ---------------------------------------------------------------------------------------------

ERROR_CASES: list[tuple[Any, int, str, str | None]] = [
    ({"documents": ["d"]}, 400, "missing_query", "query"),
    ({"query": None, "documents": ["d"]}, 400, "missing_query", "query"),
    ({"query": "", "documents": ["d"]}, 400, "empty_query", "query"),
    ({"query": " \n", "documents": ["d"]}, 400, "empty_query", "query"),
    ({"query": 5, "documents": ["d"]}, 400, "invalid_query_type", "query"),
    ({"query": [1, 2], "documents": ["d"]}, 400, "invalid_query_type", "query"),
    ({"query": {"text": "q"}, "documents": ["d"]}, 400, "invalid_query_type", "query"),
    ({"query": "q"}, 400, "missing_documents", "documents"),
    ({"query": "q", "documents": None}, 400, "missing_documents", "documents"),
    ({"query": "q", "documents": []}, 400, "empty_documents", "documents"),
    ({"query": "q", "documents": "d"}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": ["d", 5]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": [None]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": [["d"]]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": [{"title": "d"}]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": [{"text": 5}]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": [[1, 2]]}, 400, "invalid_documents_type", "documents"),
    ({"query": "q", "documents": ["d"], "top_n": "2"}, 400, "invalid_top_n_type", "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": 2.5}, 400, "invalid_top_n_type", "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": True}, 400, "invalid_top_n_type", "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": 0}, 400, "invalid_top_n", "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": -1}, 400, "invalid_top_n", "top_n"),
    ({"query": "q", "documents": ["d"], "return_documents": "true"}, 400, "invalid_return_documents_type",
     "return_documents"),
    ({"query": "q", "documents": ["d"], "return_documents": 1}, 400, "invalid_return_documents_type",
     "return_documents"),
    ({"query": "q", "documents": ["d"], "max_tokens_per_doc": "8"}, 400, "invalid_max_tokens_per_doc_type",
     "max_tokens_per_doc"),
    ({"query": "q", "documents": ["d"], "max_tokens_per_doc": 0}, 400, "invalid_max_tokens_per_doc",
     "max_tokens_per_doc"),
    ({"query": "q", "documents": ["d"], "model": 5}, 400, "invalid_model_type", "model"),
    ({"query": "q", "documents": ["d"], "model": "nope"}, 400, "model_not_found", "model"),
    ({"query": "q", "documents": ["d"] * 9}, 400, "too_many_items", "documents"),
    ({"query": "q", "documents": ["x" * 40] * 8}, 400, "too_many_tokens", "documents"),
    ({"query": "q" * 70, "documents": ["d"]}, 400, "context_length_exceeded", "documents"),
    # RFC-006's order: the first bad field wins
    ({"query": "", "documents": []}, 400, "empty_query", "query"),
    ({"query": "q", "documents": [], "top_n": 0}, 400, "empty_documents", "documents"),
    ({"query": "q", "documents": ["d"], "top_n": 0, "model": "nope"}, 400, "invalid_top_n", "top_n"),
    ("[1, 2]", 400, "invalid_body_type", None),
    ('{"query": ', 400, "invalid_json", None),
]


@pytest.mark.parametrize("body, status, code, param", ERROR_CASES, ids=[case[2] + f"-{i}"
                                                                          for i, case in enumerate(ERROR_CASES)])
def test_errors(client: Client, engine: FakeEngine, body: Any, status: int, code: str, param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    assert_error(client.post("/v1/rerank", **kwargs), status, code, param)
    assert not engine.submissions  # nothing invalid reaches the engine


def test_empty_pair_after_tokenizing(face: str) -> None:
    engine = RerankEngine()
    engine.tokenize = lambda text, add_special_tokens=True: []  # type: ignore[method-assign]
    with serve(face, make_settings(), engine) as client:
        assert_error(client.post("/rerank", json={"query": "q", "documents": ["d"]}), 400, "empty_sequence",
                     "documents")


@pytest.mark.parametrize("path", PATHS)
def test_every_path_needs_the_api_key(face: str, path: str) -> None:
    with serve(face, make_settings(api_keys=("k",)), RerankEngine()) as client:
        body = {"query": "q", "documents": ["d"]}
        assert_error(client.post(path, json=body), 401, "invalid_api_key")
        assert client.post(path, json=body, headers={"authorization": "Bearer k"}).status == 200


def test_openapi_documents_rerank() -> None:
    with serve("asgi", make_settings(), FakeEngine()) as client:
        spec = client.get("/schema/openapi.json").json()
    for path in PATHS:
        operation = spec["paths"][path]["post"]
        request = operation["requestBody"]["content"]["application/json"]["schema"]
        assert request["required"] == ["query", "documents"]
        assert set(request["properties"]) == {"query", "documents", "top_n", "return_documents",
                                              "max_tokens_per_doc", "model", "cache_salt"}
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert set(ok["required"]) == {"id", "model", "results", "usage"}
        assert set(ok["properties"]["results"]["items"]["properties"]) == {"index", "relevance_score", "document"}
        assert "x-device-time" in operation["responses"]["200"]["headers"]
        assert "invalid_top_n" in operation["responses"]["400"]["description"]
        assert "422" not in operation["responses"]


def test_rerank_error_codes_are_on_its_page() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "api" / "rerank.md").read_text()
    codes = [code for code in ERRORS if code.endswith(("_documents", "_documents_type", "top_n", "top_n_type",
                                                       "max_tokens_per_doc", "max_tokens_per_doc_type"))]
    assert len(codes) == 8
    for code in codes:
        assert f"`{code}`" in readme, code


# ---- properties (Hypothesis, on the core) ------------------------------------------------------------------

FIELDS = ("query", "documents", "top_n", "return_documents", "max_tokens_per_doc", "model")


@pytest.fixture(scope="module")
def core() -> ScoringCore:
    engine = RerankEngine()
    engine.start()
    return ScoringCore(make_settings(), engine)


@PROPERTY_SETTINGS
@given(body=json_values | st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
def test_any_body_gets_a_2xx_or_an_enveloped_4xx(core: ScoringCore, body: Any) -> None:
    assert_ok_or_enveloped_client_error(call(core, "/v1/rerank", json.dumps(body).encode()))


@PROPERTY_SETTINGS
@given(query=st.text("ab? ", min_size=1, max_size=6).filter(str.strip),
       documents=st.lists(st.text("ab* ", max_size=8), min_size=1, max_size=8),
       top_n=st.none() | st.integers(1, 10), reverse=st.booleans())
def test_results_are_sorted_in_range_and_follow_their_documents(core: ScoringCore, query: str, documents: list[str],
                                                                 top_n: int | None, reverse: bool) -> None:
    def ranked(docs: list[str]) -> list[dict]:
        reply = call(core, "/v1/rerank", json.dumps({"query": query, "documents": docs, "top_n": top_n}).encode())
        assert reply.status == 200, reply.body
        return json.loads(reply.body)["results"]

    results = ranked(documents)
    assert len(results) == min(top_n or len(documents), len(documents))
    keys = [(-r["relevance_score"], r["index"]) for r in results]
    assert keys == sorted(keys) and len({r["index"] for r in results}) == len(results)
    for result in results:
        assert 0.0 <= result["relevance_score"] <= 1.0
        assert result["document"]["text"] == documents[result["index"]]
    if reverse:  # the same documents in another order: each keeps its score
        by_text = {documents[r["index"]]: r["relevance_score"] for r in results}
        for result in ranked(documents[::-1]):
            if result["document"]["text"] in by_text:
                assert result["relevance_score"] == by_text[result["document"]["text"]]
