"""POST /v1/classify on both faces with the fake engine: vLLM's response shape and behaviours, every error."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from handler.classify import activate
from tests.handler.clients import Client
from tests.handler.conftest import assert_error, make_settings, serve
from tests.handler.fake_classifiers import (HEAD, ONE_LABEL_HEAD, PREFIX, SENTIMENT, SUFFIX, head_engine,
                                            sentiment_prompt, verbalizer_engine)
from tests.handler.fake_engine import BOS, FakeEngine, expected_logprob

TEXT = "so good"
P_POSITIVE = 1 / (1 + math.exp(-3))  # softmax of the fake log-probs 0 and -3 (the per-input constant cancels)


@pytest.fixture
def engine() -> FakeEngine:
    return verbalizer_engine()


@pytest.fixture
def client(face: str, engine: FakeEngine) -> Iterator[Client]:
    with serve(face, make_settings(), engine) as c:
        yield c


def classify(client: Client, **body: Any) -> dict:
    reply = client.post("/v1/classify", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def test_response_has_vllms_shape(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/classify", json={"input": TEXT})
    assert reply.status == 200
    body = reply.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("classify-") and len(body["id"]) == len("classify-") + 32
    assert body["object"] == "list" and isinstance(body["created"], int) and body["model"] == "sentiment"
    (entry,) = body["data"]
    assert entry["index"] == 0 and entry["label"] == "positive" and entry["num_classes"] == 2
    assert entry["probs"] == pytest.approx([P_POSITIVE, 1 - P_POSITIVE], abs=1e-7)
    n = len(sentiment_prompt(TEXT))
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.submissions[-1][:2] == ([sentiment_prompt(TEXT)], [7, 10])  # template rendered, verbalizer IDs
    assert {"x-request-id", "x-queue-time", "x-device-time", "x-total-time"} <= set(reply.headers)


def test_list_inputs_keep_their_order_and_index(client: Client, engine: FakeEngine) -> None:
    texts = ["a", "bbbbbbbb", "cc", "ddd"]
    body = classify(client, input=texts)
    assert [entry["index"] for entry in body["data"]] == [0, 1, 2, 3]
    assert engine.submissions[-1][0] == [sentiment_prompt(text) for text in texts]
    assert body["usage"]["prompt_tokens"] == sum(len(sentiment_prompt(text)) for text in texts)


def test_use_activation_false_returns_the_raw_scores(client: Client) -> None:
    texts = ["a", "bbbbbbbb"]
    body = classify(client, input=texts, use_activation=False)
    for text, entry in zip(texts, body["data"]):
        n = len(sentiment_prompt(text))
        assert entry["probs"] == [float(np.float32(expected_logprob(n, label))) for label in (7, 10)]
        assert entry["label"] == "positive"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: Client, engine: FakeEngine) -> None:
    body = classify(client, input=[TEXT, "x"], truncate_prompt_tokens=5)
    assert body["usage"]["prompt_tokens"] == 10
    assert engine.submissions[-1][0] == [sentiment_prompt(TEXT)[-5:], sentiment_prompt("x")[-5:]]
    long_text = "y" * 100  # longer than the fake engine's 64 tokens
    body = classify(client, input=long_text, truncate_prompt_tokens=-1)  # -1: the maximum sequence length
    assert body["usage"]["prompt_tokens"] == FakeEngine.max_sequence_length
    assert engine.submissions[-1][0] == [sentiment_prompt(long_text)[-64:]]
    error = assert_error(client.post("/v1/classify", json={"input": long_text}), 400, "context_length_exceeded",
                         "input")
    assert str(len(sentiment_prompt(long_text))) in error["message"] and "64" in error["message"]


def test_token_inputs_are_spliced_into_the_template(client: Client, engine: FakeEngine) -> None:
    classify(client, input=[5, 6, 7])
    classify(client, input=[[5, 6], [7]])
    prefix, suffix = list(SENTIMENT.prefix_ids), list(SENTIMENT.suffix_ids)
    assert engine.submissions[-2][0] == [prefix + [5, 6, 7] + suffix]
    assert engine.submissions[-1][0] == [prefix + [5, 6] + suffix, prefix + [7] + suffix]
    assert prefix + suffix == [BOS, *(ord(c) for c in PREFIX + SUFFIX)]


def test_model_selects_the_classifier(client: Client, engine: FakeEngine) -> None:
    body = classify(client, input="x", model="topic")
    assert body["model"] == "topic" and engine.submissions[-1][1] == [16, 14, 15]
    entry = body["data"][0]
    assert entry["num_classes"] == 3 and entry["label"] == "politics"  # label 14 scores highest (0)
    assert entry["probs"] == pytest.approx(list(activate(np.array([[-2.0, 0.0, -1.0]]), "softmax")[0]))
    assert classify(client, input="x", model="sentiment")["model"] == "sentiment"
    assert classify(client, input="x", model=None)["model"] == "sentiment"  # the first classifier
    assert classify(client, input="x", model="fake-model")["model"] == "sentiment"  # the served model's id
    error = assert_error(client.post("/v1/classify", json={"input": "x", "model": "gpt-4"}), 400,
                         "model_not_found", "model")
    assert "['sentiment', 'topic']" in error["message"]


def test_tracking_fields_are_accepted(client: Client) -> None:
    body = classify(client, input="x", user="u-1", rid="r-1", priority=3, unknown_field=[1])
    assert body["data"][0]["label"] == "positive"
    classify(client, input="x", user=None, rid=None, priority=None, truncate_prompt_tokens=None, use_activation=None)


def test_models_lists_the_classifiers_with_their_labels(client: Client) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [card["id"] for card in data] == ["fake-model", "sentiment", "topic"]
    assert set(data[0]) == {"id", "object", "created", "owned_by", "batch_invariant", "dtype"}
    assert data[1] == {"id": "sentiment", "object": "model", "created": data[0]["created"], "owned_by": "scorefn",
                       "parent": "fake-model", "task": "classify", "labels": ["positive", "negative"]}
    assert data[2]["labels"] == ["sports", "politics", "science"]


def test_both_faces_answer_the_same() -> None:
    bodies = []
    for face in ("asgi", "wsgi"):
        with serve(face, make_settings(), verbalizer_engine()) as client:
            body = classify(client, input=["a", "b"], model="topic", truncate_prompt_tokens=4)
            bodies.append({k: v for k, v in body.items() if k not in ("id", "created")})
    assert bodies[0] == bodies[1]


# ---- a sequence-classification model ------------------------------------------------------------------

@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_classification_head(face: str) -> None:
    engine = head_engine()
    with serve(face, make_settings(), engine) as client:
        body = classify(client, input=["good", "bad"])
        assert body["model"] == "fake-model"
        assert engine.submissions[-1] == ([[BOS, *map(ord, "good")], [BOS, *map(ord, "bad")]], [0, 1, 2],
                                          engine.submissions[-1][2])  # the input as is, every score row
        expected = activate(np.array([[0.0, -1.0, -2.0]]), "softmax")[0]
        for entry in body["data"]:
            assert entry["label"] == "negative" and entry["num_classes"] == 3
            assert entry["probs"] == pytest.approx(list(expected))
        assert classify(client, input=[1, 2, 3])["usage"]["prompt_tokens"] == 3  # token IDs: as given
        assert engine.submissions[-1][0] == [[1, 2, 3]]
        error = assert_error(client.post("/v1/classify", json={"input": "x", "model": "sentiment"}), 400,
                             "model_not_found", "model")
        assert "['fake-model']" in error["message"]
        cards = client.get("/v1/models").json()["data"]
        assert len(cards) == 1 and cards[0]["task"] == "classify" and cards[0]["labels"] == list(HEAD.labels)
        assert "parent" not in cards[0]
        error = assert_error(client.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]}),
                             400, "model_not_supported", None, "model_error")
        assert "/v1/classify" in error["message"]


@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_one_label_head_uses_sigmoid(face: str) -> None:
    with serve(face, make_settings(), head_engine(ONE_LABEL_HEAD)) as client:
        (entry,) = classify(client, input="hello")["data"]
        n = len("hello") + 1
        assert entry["probs"] == pytest.approx([1 / (1 + math.exp(-expected_logprob(n, 3)))])
        assert entry["label"] == "LABEL_0" and entry["num_classes"] == 1
        (raw,) = classify(client, input="hello", use_activation=False)["data"]
        assert raw["probs"] == pytest.approx([expected_logprob(n, 3)], abs=1e-6)


def test_no_classifier_is_a_clear_400(face: str) -> None:
    with serve(face, make_settings(), FakeEngine()) as client:
        error = assert_error(client.post("/v1/classify", json={"input": "x"}), 400, "model_not_supported", None)
        assert "SCOREFN_CLASSIFIERS" in error["message"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"


# ---- errors ---------------------------------------------------------------------------------------------

ERROR_CASES: list[tuple[Any, int, str, str | None]] = [
    ({}, 400, "missing_input", "input"),
    ({"input": None}, 400, "missing_input", "input"),
    ({"input": ""}, 400, "empty_input", "input"),
    ({"input": " \n\t "}, 400, "empty_input", "input"),
    ({"input": []}, 400, "empty_input", "input"),
    ({"input": [""]}, 400, "empty_input", "input"),
    ({"input": ["a", "  "]}, 400, "empty_input", "input"),
    ({"input": [[]]}, 400, "empty_input", "input"),
    ({"input": [[1], []]}, 400, "empty_input", "input"),
    ({"input": 5}, 400, "invalid_input_type", "input"),
    ({"input": {"text": "a"}}, 400, "invalid_input_type", "input"),
    ({"input": ["a", 1]}, 400, "invalid_input_type", "input"),
    ({"input": [1, "a"]}, 400, "invalid_input_type", "input"),
    ({"input": [1.5]}, 400, "invalid_input_type", "input"),
    ({"input": [True]}, 400, "invalid_input_type", "input"),
    ({"input": [["a"]]}, 400, "invalid_input_type", "input"),
    ({"input": [2**70]}, 400, "invalid_input_type", "input"),
    ({"input": [5, -1]}, 400, "negative_token_id", "input"),
    ({"input": [[5], [1000]]}, 422, "token_id_exceeds_vocab", "input"),
    ({"input": [999, 1000]}, 422, "token_id_exceeds_vocab", "input"),
    ({"input": "a", "truncate_prompt_tokens": "5"}, 400, "invalid_truncate_prompt_tokens_type",
     "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 2.0}, 400, "invalid_truncate_prompt_tokens_type",
     "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": True}, 400, "invalid_truncate_prompt_tokens_type",
     "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 0}, 400, "invalid_truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": -2}, 400, "invalid_truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": "a", "truncate_prompt_tokens": 65}, 400, "invalid_truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": "a", "use_activation": "false"}, 400, "invalid_use_activation_type", "use_activation"),
    ({"input": "a", "use_activation": 0}, 400, "invalid_use_activation_type", "use_activation"),
    ({"input": "a", "user": 5}, 400, "invalid_user_type", "user"),
    ({"input": "a", "rid": ["r"]}, 400, "invalid_rid_type", "rid"),
    ({"input": "a", "priority": "high"}, 400, "invalid_priority_type", "priority"),
    ({"input": "a", "model": 5}, 400, "invalid_model_type", "model"),
    ({"input": "a", "model": "nope"}, 400, "model_not_found", "model"),
    ({"input": ["a"] * 9}, 400, "too_many_items", "input"),
    ({"input": ["x" * 40] * 8}, 400, "too_many_tokens", "input"),
    ({"input": "q" * 70}, 400, "context_length_exceeded", "input"),
    ({"input": [[1] * 60]}, 400, "context_length_exceeded", "input"),  # 60 + the template's 18 tokens
    ("[1, 2]", 400, "invalid_body_type", None),
    ('{"input": ', 400, "invalid_json", None),
]


@pytest.mark.parametrize("body, status, code, param", ERROR_CASES, ids=[case[2] + f"-{i}"
                                                                          for i, case in enumerate(ERROR_CASES)])
def test_errors(client: Client, engine: FakeEngine, body: Any, status: int, code: str, param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    assert_error(client.post("/v1/classify", **kwargs), status, code, param)
    assert not engine.submissions  # nothing invalid reaches the engine


def test_empty_element_is_named(client: Client) -> None:
    error = assert_error(client.post("/v1/classify", json={"input": ["a", "b", " "]}), 400, "empty_input", "input")
    assert "input[2]" in error["message"]


def test_empty_prompt_after_tokenizing(face: str) -> None:
    engine = head_engine()
    engine.tokenize = lambda text, add_special_tokens=True: []  # type: ignore[method-assign]
    with serve(face, make_settings(), engine) as client:
        assert_error(client.post("/v1/classify", json={"input": "x"}), 400, "empty_sequence", "input")


def test_template_text_is_not_counted_against_truncation_errors(client: Client) -> None:
    # A prompt within the limit only because of truncation is accepted; the template's own tokens count.
    n_template = len(sentiment_prompt(""))
    assert classify(client, input="z" * (64 - n_template))["usage"]["prompt_tokens"] == 64
    assert_error(client.post("/v1/classify", json={"input": "z" * (65 - n_template)}), 400,
                 "context_length_exceeded", "input")


def test_openapi_documents_classify() -> None:
    with serve("asgi", make_settings(), FakeEngine()) as client:
        spec = client.get("/schema/openapi.json").json()
    operation = spec["paths"]["/v1/classify"]["post"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]
    assert request["required"] == ["input"]
    assert set(request["properties"]) == {"input", "model", "truncate_prompt_tokens", "use_activation", "user", "rid",
                                          "priority", "cache_salt"}
    assert len(request["properties"]["input"]["anyOf"]) == 4
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(ok["required"]) >= {"id", "created", "model", "data", "usage"}
    assert set(ok["properties"]["data"]["items"]["properties"]) == {"index", "label", "probs", "num_classes"}
    assert "x-device-time" in operation["responses"]["200"]["headers"]
    assert "token_id_exceeds_vocab" in operation["responses"]["422"]["description"]
    assert "model_not_supported" in operation["responses"]["400"]["description"]
    cards = spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {"labels", "task", "parent"} <= set(cards["properties"]["data"]["items"]["properties"])


def test_sentiment_prompt_helper_matches_the_classifier() -> None:
    assert sentiment_prompt(TEXT) == [BOS, *(ord(c) for c in SENTIMENT.render(TEXT))]
    assert SENTIMENT.render(TEXT) == PREFIX + TEXT + SUFFIX


def test_classify_error_codes_are_on_its_page() -> None:
    from pathlib import Path

    from handler.errors import ERRORS

    readme = (Path(__file__).resolve().parents[2] / "docs" / "api" / "classify.md").read_text()
    codes = [code for code in ERRORS if code.endswith(("_input", "_input_type", "truncate_prompt_tokens",
                                                       "truncate_prompt_tokens_type", "use_activation_type",
                                                       "user_type", "rid_type", "priority_type"))]
    assert len(codes) == 9 and "model_not_supported" in ERRORS
    for code in [*codes, "model_not_supported"]:
        assert f"`{code}`" in readme, code
