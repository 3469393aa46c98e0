"""What /v1/score computes and returns, checked against the fake engine's hand-computable scores."""

from __future__ import annotations

import math
import re

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import score_body
from tests.handler.fake_engine import BOS, FakeEngine, expected_logprob


def _ids(text: str) -> list[int]:
    return [ord(c) % 1000 for c in text]


def test_response_shape(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body())
    assert reply.status == 200
    data = reply.json()
    assert list(data) == ["id", "object", "created", "model", "scores", "usage"]
    assert re.fullmatch(r"score-[0-9a-f]{32}", data["id"])
    assert data["object"] == "scoring" and data["model"] == "fake-model"
    assert isinstance(data["created"], int) and data["created"] > 1_700_000_000
    assert data["usage"] == {"prompt_tokens": 4 + 5, "completion_tokens": 0, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_text_mode_tokenizes_query_plus_item_with_special_tokens(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/score", json=score_body(query="ab", items=["c", "de", ""], label_token_ids=[3, 10]))
    sequences, labels, _ = engine.submissions[-1]
    assert sequences == [[BOS, *_ids("abc")], [BOS, *_ids("abde")], [BOS, *_ids("ab")]]
    assert labels == [3, 10]
    scores = reply.json()["scores"]
    for sequence, row in zip(sequences, scores):
        assert row == pytest.approx([expected_logprob(len(sequence), 3), expected_logprob(len(sequence), 10)],
                                    abs=1e-6)


def test_item_first_text(client: Client, engine: FakeEngine) -> None:
    client.post("/v1/score", json=score_body(query="ab", items=["c"], item_first=True))
    assert engine.submissions[-1][0] == [[BOS, *_ids("cab")]]


def test_token_mode_concatenates_as_given(client: Client, engine: FakeEngine) -> None:
    body = score_body(query=[5, 6], items=[[7], [], [8, 9]], label_token_ids=[0, 999])
    reply = client.post("/v1/score", json=body)
    assert reply.status == 200
    assert engine.submissions[-1][0] == [[5, 6, 7], [5, 6], [5, 6, 8, 9]]
    assert reply.json()["usage"]["prompt_tokens"] == 3 + 2 + 4
    client.post("/v1/score", json={**body, "item_first": True})
    assert engine.submissions[-1][0] == [[7, 5, 6], [5, 6], [8, 9, 5, 6]]


def test_logprobs_are_returned_as_is_by_default(client: Client) -> None:
    scores = client.post("/v1/score", json=score_body(query=[1] * 9, items=[[2]], label_token_ids=[0, 1, 6]))
    assert scores.json()["scores"] == [pytest.approx([-0.1, -1.1, -6.1], abs=1e-6)]


def test_softmax_rows_sum_to_one(client: Client) -> None:
    labels = [0, 1, 2, 5, 13]
    reply = client.post("/v1/score", json=score_body(items=["x", "yy", "zzz"], label_token_ids=labels,
                                                     apply_softmax=True))
    rows = reply.json()["scores"]
    assert len(rows) == 3
    for row in rows:
        assert math.fsum(row) == pytest.approx(1.0, abs=1e-12)  # float64 on the host
        # softmax over the labels only: the sequence-length term cancels
        weights = [math.exp(-(label % 7)) for label in labels]
        assert row == pytest.approx([w / sum(weights) for w in weights], abs=1e-6)


def test_duplicate_labels_repeat_their_values(client: Client) -> None:
    for apply_softmax in (False, True):
        reply = client.post("/v1/score", json=score_body(label_token_ids=[4, 9, 4, 4], apply_softmax=apply_softmax))
        for row in reply.json()["scores"]:
            assert row[0] == row[2] == row[3] and len(row) == 4
            if apply_softmax:
                assert math.fsum(row) == pytest.approx(1.0, abs=1e-12)


def test_scores_keep_item_and_label_order(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body(query=[1], items=[[2] * k for k in range(5)],
                                                     label_token_ids=[6, 0, 3]))
    for k, row in enumerate(reply.json()["scores"]):
        assert row == pytest.approx([expected_logprob(k + 1, label) for label in (6, 0, 3)], abs=1e-6)


def test_unicode_text(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/score", json=score_body(query="Zürich 😀", items=["\u00a0\n\t\"\\"]))
    assert reply.status == 200
    assert engine.submissions[-1][0] == [[BOS, *_ids("Zürich 😀\u00a0\n\t\"\\")]]


def test_deadline_is_passed_to_the_engine(client: Client, engine: FakeEngine) -> None:
    import time

    before = time.monotonic()
    client.post("/v1/score", json=score_body())
    deadline = engine.submissions[-1][2]
    assert deadline is not None and before + 29 < deadline <= time.monotonic() + 30


def test_timing_headers(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body())
    assert reply.headers["x-queue-time"] == "0.250000"  # the fake engine's
    assert reply.headers["x-device-time"] == "0.500000"
    assert re.fullmatch(r"\d+\.\d{6}", reply.headers["x-total-time"])
    assert re.fullmatch(r"[0-9a-f]{32}", reply.headers["x-request-id"])


def test_request_id_is_echoed(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body(), headers={"x-request-id": "trace-42/abc"})
    assert reply.headers["x-request-id"] == "trace-42/abc"
    error = client.post("/v1/score", json=score_body(items=[]), headers={"x-request-id": "trace-43"})
    assert error.headers["x-request-id"] == "trace-43" and "x-total-time" in error.headers
    too_long = client.post("/v1/score", json=score_body(), headers={"x-request-id": "x" * 500})
    assert re.fullmatch(r"[0-9a-f]{32}", too_long.headers["x-request-id"])


def test_ids_are_unique(client: Client) -> None:
    ids = {client.post("/v1/score", json=score_body()).json()["id"] for _ in range(5)}
    assert len(ids) == 5


def test_trailing_slash_is_the_same_endpoint(client: Client) -> None:
    assert client.post("/v1/score/", json=score_body()).status == 200
