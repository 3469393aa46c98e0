"""RFC-006's validation table row by row (exact type, param, code, message) and the order between rows."""

from __future__ import annotations

from typing import Any

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import assert_error, score_body

# (request fields, status, type, param, code, message) — RFC-006's rows in its order, messages verbatim.
RFC_006_ROWS = [
    (dict(query=...), 400, "missing_parameter_error", "query", "missing_query", "query is required"),
    (dict(query=""), 400, "invalid_value_error", "query", "empty_query", "query cannot be empty"),
    (dict(query={"text": "ab"}), 400, "invalid_request_error", "query", "invalid_query_type",
     "query must be a string or list of integers"),
    (dict(items=...), 400, "missing_parameter_error", "items", "missing_items", "items is required"),
    (dict(items=[]), 400, "invalid_value_error", "items", "empty_items",
     "items cannot be empty. At least one item is required."),
    (dict(items="c"), 400, "invalid_request_error", "items", "invalid_items_type",
     "items must be a list of strings or list of token ID lists"),
    (dict(items=[[99]]), 400, "invalid_request_error", "items", "mixed_input_types",
     "query and items must both be text (str) or both be tokens (list[int]). "
     "Got query type: str, items[0] type: list[int]"),
    (dict(label_token_ids=...), 400, "missing_parameter_error", "label_token_ids", "missing_label_token_ids",
     "label_token_ids is required"),
    (dict(label_token_ids=[]), 400, "invalid_value_error", "label_token_ids", "empty_label_token_ids",
     "label_token_ids cannot be empty. At least one label token ID is required."),
    (dict(label_token_ids=[-1]), 400, "invalid_value_error", "label_token_ids", "negative_token_id",
     "label_token_ids cannot contain negative values. Got: [-1]"),
    (dict(label_token_ids=[999999]), 422, "invalid_value_error", "label_token_ids", "token_id_exceeds_vocab",
     "label_token_ids contains token ID 999999 which exceeds vocabulary size 1000 (valid IDs are 0 to 999)"),
    (dict(label_token_ids={"a": 1}), 400, "invalid_request_error", "label_token_ids",
     "invalid_label_token_ids_type", "label_token_ids must be a list of integers"),
    (dict(label_token_ids=[1, "x"]), 400, "invalid_request_error", "label_token_ids", "invalid_token_id_type",
     "label_token_ids must contain only integers"),
    (dict(apply_softmax="yes"), 400, "invalid_request_error", "apply_softmax", "invalid_apply_softmax_type",
     "apply_softmax must be a boolean"),
    (dict(item_first="no"), 400, "invalid_request_error", "item_first", "invalid_item_first_type",
     "item_first must be a boolean"),
    (dict(model="llama"), 400, "model_error", "model", "model_not_found",
     "Model 'llama' not found. Available models: ['fake-model']"),
]


@pytest.mark.parametrize("fields,status,error_type,param,code,message", RFC_006_ROWS,
                         ids=[row[4] for row in RFC_006_ROWS])
def test_rfc_006_row(client: Client, fields: dict, status: int, error_type: str, param: str, code: str,
                     message: str) -> None:
    error = assert_error(client.post("/v1/score", json=score_body(**fields)), status, code, param, error_type)
    assert error["message"] == message


def _first_error(client: Client, **fields: Any) -> str:
    reply = client.post("/v1/score", json=score_body(**fields))
    assert reply.status in (400, 422), reply.body
    return reply.json()["error"]["code"]


# Each request breaks several rules; the earliest in RFC-006's order wins.
ORDER_CASES = [
    (dict(query=..., items=[], label_token_ids=[]), "missing_query"),
    (dict(query=5, items=..., label_token_ids=[-1]), "invalid_query_type"),
    (dict(query="", items=...), "empty_query"),
    (dict(query=[-1], items="bad"), "negative_token_id"),  # the query's own range check comes before items
    (dict(items=..., label_token_ids=...), "missing_items"),
    (dict(items=5, label_token_ids=[]), "invalid_items_type"),
    (dict(items=[], label_token_ids=[-1]), "empty_items"),
    (dict(items=[[1]], label_token_ids=[]), "mixed_input_types"),
    (dict(label_token_ids=..., apply_softmax="x"), "missing_label_token_ids"),
    (dict(label_token_ids=[], apply_softmax="x"), "empty_label_token_ids"),
    (dict(label_token_ids=[-1, "a"]), "invalid_token_id_type"),  # type before value, as RFC-006's code does
    (dict(label_token_ids=[5000, -1]), "negative_token_id"),
    (dict(label_token_ids=[5000], apply_softmax="x"), "token_id_exceeds_vocab"),
    (dict(apply_softmax=1, item_first=1), "invalid_apply_softmax_type"),
    (dict(item_first=1, model="nope"), "invalid_item_first_type"),
    (dict(model="nope", items=["x"] * 100), "model_not_found"),
    (dict(items=["x"] * 100, label_token_ids=list(range(100))), "too_many_items"),
    (dict(label_token_ids=list(range(100)), query="q" * 100), "too_many_labels"),
    (dict(query="q" * 100, items=["x"] * 8), "context_length_exceeded"),
]


@pytest.mark.parametrize("fields,code", ORDER_CASES, ids=[f"{i}-{c}" for i, (_, c) in enumerate(ORDER_CASES)])
def test_validation_order(client: Client, fields: dict, code: str) -> None:
    assert _first_error(client, **fields) == code


def test_token_mode_query_ids_are_range_checked(client: Client) -> None:
    body = score_body(query=[5, -3, -4], items=[[1]])
    error = assert_error(client.post("/v1/score", json=body), 400, "negative_token_id", "query")
    assert error["message"] == "query cannot contain negative values. Got: [-3, -4]"
    error = assert_error(client.post("/v1/score", json=score_body(query=[5, 1000], items=[[1]])), 422,
                         "token_id_exceeds_vocab", "query")
    assert "1000" in error["message"] and "vocabulary size 1000" in error["message"]


def test_token_mode_item_ids_are_range_checked(client: Client) -> None:
    body = score_body(query=[5], items=[[1], [], [2, -7]])
    assert_error(client.post("/v1/score", json=body), 400, "negative_token_id", "items")
    error = assert_error(client.post("/v1/score", json=score_body(query=[5], items=[[1], [4096]])), 422,
                         "token_id_exceeds_vocab", "items")
    assert error["message"].startswith("items contains token ID 4096 which exceeds vocabulary size 1000")


def test_label_bounds_are_inclusive_of_zero_and_vocab_minus_one(client: Client) -> None:
    assert client.post("/v1/score", json=score_body(label_token_ids=[0, 999])).status == 200
    assert_error(client.post("/v1/score", json=score_body(label_token_ids=[1000])), 422, "token_id_exceeds_vocab",
                 "label_token_ids")


def test_empty_token_query_is_rejected_like_an_empty_string(client: Client) -> None:
    assert_error(client.post("/v1/score", json=score_body(query=[], items=[[1]])), 400, "empty_query", "query")


def test_limit_messages_state_limit_and_value(client: Client) -> None:
    error = assert_error(client.post("/v1/score", json=score_body(query="q" * 70)), 400,
                         "context_length_exceeded", "items")
    # BOS + "q"*70 + "c" = 72 tokens; the fake engine's limit is 64
    assert error["message"] == ("items[0]: the sequence has 72 tokens, more than the maximum sequence length "
                                "of 64 tokens.")
    error = assert_error(client.post("/v1/score", json=score_body(items=["x"] * 9)), 400, "too_many_items", "items")
    assert "9" in error["message"] and "limit of 8" in error["message"]
    error = assert_error(client.post("/v1/score", json=score_body(label_token_ids=[1] * 17)), 400,
                         "too_many_labels", "label_token_ids")
    assert "17" in error["message"] and "limit of 16" in error["message"]
    error = assert_error(client.post("/v1/score", json=score_body(items=["x" * 40] * 8)), 400,
                         "too_many_tokens", "items")
    assert "344 tokens" in error["message"] and "limit of 300" in error["message"]  # 8 x (BOS + "ab" + 40)


def test_context_limit_names_the_offending_item(client: Client) -> None:
    body = score_body(query=[5] * 10, items=[[1] * 10, [2] * 60])
    error = assert_error(client.post("/v1/score", json=body), 400, "context_length_exceeded", "items")
    assert error["message"].startswith("items[1]: the sequence has 70 tokens")
    assert client.post("/v1/score", json=score_body(query=[5] * 10, items=[[2] * 54])).status == 200  # exactly 64


def test_model_may_be_given_omitted_or_null(client: Client) -> None:
    for model in ("fake-model", ..., None):
        reply = client.post("/v1/score", json=score_body(model=model))
        assert reply.status == 200 and reply.json()["model"] == "fake-model"


def test_nulls_count_as_absent(client: Client) -> None:
    assert _first_error(client, query=None) == "missing_query"
    assert _first_error(client, items=None) == "missing_items"
    assert _first_error(client, label_token_ids=None) == "missing_label_token_ids"
    reply = client.post("/v1/score", json=score_body(apply_softmax=None, item_first=None))
    assert reply.status == 200


def test_long_model_name_is_cut_in_the_message(client: Client) -> None:
    error = assert_error(client.post("/v1/score", json=score_body(model="m" * 10_000)), 400, "model_not_found",
                         "model")
    assert len(error["message"]) < 400
