"""`model` selects a LoRA adapter on every scoring endpoint (both faces, the fake engine): the engine gets the
adapter's name, the response names it, GET /v1/models lists it with its parent, and an unknown name is
model_not_found listing what is served."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import assert_error, make_settings, score_body, serve
from tests.handler.fake_engine import FakeEngine
from tests.handler.fake_rerankers import RELEVANCE, RerankEngine

ADAPTERS = ("toxicity", "pii")


@pytest.fixture
def engine() -> FakeEngine:
    engine = RerankEngine()
    engine.adapters = ADAPTERS
    return engine


@pytest.fixture
def client(face: str, engine: FakeEngine) -> Iterator[Client]:
    with serve(face, make_settings(), engine) as c:
        yield c


BODIES = {
    "/v1/score": score_body(),
    "/v1/completions": {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1},
    "/v1/rerank": {"query": "q", "documents": ["d", "e"]},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_request_names_an_adapter_and_is_answered_as_it(client: Client, engine: FakeEngine, path: str) -> None:
    reply = client.post(path, json={**BODIES[path], "model": "pii"})
    assert reply.status == 200, reply.body
    assert reply.json()["model"] == "pii" and engine.adapters_used == ["pii"]


@pytest.mark.parametrize("path", sorted(BODIES))
def test_no_model_or_the_served_id_is_the_base_model(client: Client, engine: FakeEngine, path: str) -> None:
    for model in (None, "fake-model"):
        assert client.post(path, json={**BODIES[path], "model": model}).status == 200
    assert engine.adapters_used == [None, None]


@pytest.mark.parametrize("path", sorted(BODIES))
def test_an_unknown_model_lists_the_adapters(client: Client, engine: FakeEngine, path: str) -> None:
    error = assert_error(client.post(path, json={**BODIES[path], "model": "toxic"}), 400, "model_not_found", "model")
    assert "'toxicity', 'pii'" in error["message"]
    assert engine.adapters_used == []


def test_a_reranker_runs_with_the_adapter_named(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/rerank", json={**BODIES["/v1/rerank"], "model": "toxicity"})
    assert reply.status == 200 and engine.adapters_used == ["toxicity"]
    assert engine.submissions[0][1] == list(RELEVANCE.label_ids)  # the default reranker's labels


def test_models_lists_each_adapter_with_its_parent(client: Client) -> None:
    data = client.get("/v1/models").json()["data"]
    cards = {card["id"]: card for card in data}
    for name in ADAPTERS:
        assert cards[name] == {"id": name, "object": "model", "created": data[0]["created"], "owned_by": "scorefn",
                               "parent": "fake-model", "task": "lora"}
