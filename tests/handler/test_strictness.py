"""Strict types and malformed bodies: always a 4xx RFC-006 envelope, never a 500 or a framework body."""

from __future__ import annotations

from typing import Any

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import assert_error, score_body

HUGE = 10**30  # beyond int64, still an integer msgspec can hold
ENORMOUS = "1" * 5000  # beyond what msgspec decodes as an integer at all


@pytest.mark.parametrize("value", ["true", 1, 0, "false", [], {}, 1.0])
@pytest.mark.parametrize("field", ["apply_softmax", "item_first"])
def test_booleans_are_only_json_booleans(client: Client, field: str, value: Any) -> None:
    assert_error(client.post("/v1/score", json=score_body(**{field: value})), 400, f"invalid_{field}_type", field)


@pytest.mark.parametrize("labels", [[True], [False], [2.5], [1.0], ["3"], [None], [[[1]]], [[1, True]], [[1.0]],
                                    [[None]], [{"id": 1}], [HUGE], [-HUGE], [2**63], [[1, 2**63]]])
def test_non_integer_label_ids(client: Client, labels: list) -> None:
    assert_error(client.post("/v1/score", json=score_body(label_token_ids=labels)), 400, "invalid_token_id_type",
                 "label_token_ids")


@pytest.mark.parametrize("labels", ["3", 3, True, {"0": 1}, 2.5])
def test_label_ids_not_a_list(client: Client, labels: Any) -> None:
    assert_error(client.post("/v1/score", json=score_body(label_token_ids=labels)), 400,
                 "invalid_label_token_ids_type", "label_token_ids")


def test_int64_edges(client: Client) -> None:
    assert_error(client.post("/v1/score", json=score_body(label_token_ids=[2**63 - 1])), 422,
                 "token_id_exceeds_vocab", "label_token_ids")
    assert_error(client.post("/v1/score", json=score_body(label_token_ids=[-(2**63)])), 400, "negative_token_id",
                 "label_token_ids")


@pytest.mark.parametrize("query", [True, 1, 2.5, {}, [True], [1.5], ["a"], [HUGE], [[1]], [1, None]])
def test_query_types(client: Client, query: Any) -> None:
    assert_error(client.post("/v1/score", json=score_body(query=query, items=[[1]])), 400, "invalid_query_type",
                 "query")


@pytest.mark.parametrize("items", ["abc", [1], [True], [["a"]], ["a", [1]], [[1, 2.5]], [[HUGE]], {"a": 1},
                                   [None], [[True]], 7])
def test_items_types(client: Client, items: Any) -> None:
    assert_error(client.post("/v1/score", json=score_body(query=[1], items=items)), 400, "invalid_items_type",
                 "items")


@pytest.mark.parametrize("content", [
    b'{"query": "ab", "items": ["c"], "label_token_ids": [' + ENORMOUS.encode() + b"]}",
    b'{"query": [' + ENORMOUS.encode() + b'], "items": [[1]], "label_token_ids": [1]}',
    b'{"query": [1], "items": [[-' + ENORMOUS.encode() + b']], "label_token_ids": [1]}',
    b'{"query": "ab", "items": ["c"], "label_token_ids": [1e400]}',
], ids=["label", "query", "items", "float-overflow"])
def test_numbers_beyond_any_range_are_400(client: Client, content: bytes) -> None:
    reply = client.post("/v1/score", content=content)
    assert reply.status == 400
    assert reply.json()["error"]["code"] in ("invalid_token_id_type", "invalid_query_type", "invalid_items_type")


def test_unknown_fields_are_ignored(client: Client) -> None:
    body = score_body(temperature=0.7, stream=True, extra={"nested": [1, [2, [3]]]}, n=10**40)
    assert client.post("/v1/score", json=body).status == 200


MALFORMED = {
    "empty": (b"", "invalid_json"),
    "whitespace": (b"  \n", "invalid_json"),
    "not-json": (b"query=ab&items=c", "invalid_json"),
    "truncated": (b'{"query": "ab", "items": ["c"', "invalid_json"),
    "trailing-garbage": (b'{"query": "ab"} xyz', "invalid_json"),
    "single-quotes": (b"{'query': 'ab'}", "invalid_json"),
    "nan": (b'{"query": "ab", "items": ["c"], "label_token_ids": [NaN]}', "invalid_json"),
    "bad-utf8": (b'{"query": "\xff\xfe", "items": ["c"], "label_token_ids": [1]}', "invalid_json"),
    "bad-utf8-in-unknown-field": (b'{"zz": "\xc3\x28", "query": "ab"}', "invalid_json"),
    "lone-surrogate": (b'{"query": "\\ud800", "items": ["c"], "label_token_ids": [1]}', "invalid_json"),
    "deep-nesting": (b'{"zz": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "invalid_json"),
    "null": (b"null", "invalid_body_type"),
    "array": (b"[]", "invalid_body_type"),
    "string": (b'"query"', "invalid_body_type"),
    "number": (b"42", "invalid_body_type"),
    "huge-number": (b"1e400", "invalid_body_type"),
    "true": (b"true", "invalid_body_type"),
    "empty-object": (b"{}", "missing_query"),
    "all-null": (b'{"query": null, "items": null, "label_token_ids": null}', "missing_query"),
    "nested-garbage": (b'{"query": {"a": [{"b": null}]}, "items": [[[[]]]], "label_token_ids": [[[]]]}',
                       "invalid_query_type"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_bodies(client: Client, name: str) -> None:
    content, code = MALFORMED[name]
    reply = client.post("/v1/score", content=content, headers={"content-type": "application/json"})
    assert 400 <= reply.status < 500, reply.body
    assert reply.json()["error"]["code"] == code


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_tokenize_bodies(client: Client, name: str) -> None:
    content, _ = MALFORMED[name]
    reply = client.post("/v1/tokenize", content=content)
    assert 400 <= reply.status < 500, reply.body
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_content_type_is_not_required(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body(), headers={"content-type": "text/plain"})
    assert reply.status == 200
