"""`model` selects a LoRA adapter on every scoring endpoint (both faces, the fake engine): the engine gets the
adapter's name, the response names it, GET /v1/models lists it with its parent, and an unknown name is
model_not_found listing what is served."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime.tasks.classifiers import Classifier
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


JUDGE = Classifier(name="judge", labels=("LABEL_0", "LABEL_1", "LABEL_2"), label_ids=(0, 1, 2), activation="softmax",
                   adapter="judge")


@pytest.fixture
def classifying(face: str) -> Iterator[tuple[Client, FakeEngine]]:
    """A causal LM served with a causal adapter and a classification adapter (its own head: a classifier)."""
    engine = RerankEngine()
    engine.adapters, engine.classifiers = ("pii", "judge"), (JUDGE,)
    with serve(face, make_settings(), engine) as c:
        yield c, engine


def test_a_classification_adapter_is_a_classifier_of_its_name(classifying) -> None:
    client, engine = classifying
    reply = client.post("/v1/classify", json={"model": "judge", "input": ["a", "b"]})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["model"] == "judge" and engine.adapters_used == ["judge"] and engine.submissions[0][1] == [0, 1, 2]
    assert [row["num_classes"] for row in body["data"]] == [3, 3]
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards["judge"]["task"] == "classify" and cards["judge"]["labels"] == list(JUDGE.labels)
    assert cards["judge"]["parent"] == "fake-model" and cards["pii"]["task"] == "lora"
    assert [card["id"] for card in client.get("/v1/models").json()["data"]].count("judge") == 1


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_classification_adapter_is_refused_where_it_has_no_answer(classifying, path: str) -> None:
    client, engine = classifying
    error = assert_error(client.post(path, json={**BODIES[path], "model": "judge"}), 400, "model_not_supported",
                         "model")
    assert "use /v1/classify" in error["message"] and engine.adapters_used == []
