"""/v1/score's labels of several tokens: label_token_ids' lists, `labels` as text, normalization, token_logprobs."""

from __future__ import annotations

import math

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import assert_error, score_body
from tests.handler.fake_engine import BOS, FakeEngine, expected_logprob


def _ids(text: str) -> list[int]:
    return [ord(c) % 1000 for c in text]


def _label_logprob(sequence_length: int, label: list[int]) -> float:
    """The fake engine's log-probability of a label: token k after the sequence and the label's k tokens."""
    return sum(expected_logprob(sequence_length + k, token) for k, token in enumerate(label))


def test_lists_of_token_ids_sum_their_tokens(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/score", json=score_body(query=[5, 6], items=[[7], [8, 9]],
                                                     label_token_ids=[[3, 4, 5], 10, [11, 12]]))
    assert reply.status == 200, reply.body
    assert engine.submissions[-1][1] == [[3, 4, 5], 10, [11, 12]]
    for length, row in zip((3, 4), reply.json()["scores"]):
        assert row == pytest.approx([_label_logprob(length, [3, 4, 5]), expected_logprob(length, 10),
                                     _label_logprob(length, [11, 12])], abs=1e-5)
    assert "token_logprobs" not in reply.json()


def test_a_one_token_list_is_that_token_id(client: Client, engine: FakeEngine) -> None:
    as_lists = client.post("/v1/score", json=score_body(label_token_ids=[[3], [10]]))
    assert engine.submissions[-1][1] == [3, 10]  # the one-token path, the same bits as the IDs
    assert as_lists.json()["scores"] == client.post("/v1/score", json=score_body(label_token_ids=[3, 10])).json()[
        "scores"]


def test_labels_as_text_are_tokenized_as_continuations(client: Client, engine: FakeEngine) -> None:
    reply = client.post("/v1/score", json=score_body(query="ab", items=["c"], label_token_ids=...,
                                                     labels=[" yes", "n"]))
    assert reply.status == 200, reply.body
    sequences, labels, _ = engine.submissions[-1]
    assert sequences == [[BOS, *_ids("abc")]] and labels == [_ids(" yes"), _ids("n")[0]]  # no BOS on a label
    assert reply.json()["scores"][0] == pytest.approx([_label_logprob(4, _ids(" yes")),
                                                       expected_logprob(4, _ids("n")[0])], abs=1e-5)


def test_mean_normalization_divides_by_the_token_count(client: Client) -> None:
    body = score_body(items=["c"], label_token_ids=[[3, 4, 5, 6], 10])
    total = client.post("/v1/score", json=body).json()["scores"][0]
    mean = client.post("/v1/score", json={**body, "label_normalization": "mean"}).json()["scores"][0]
    assert mean == pytest.approx([total[0] / 4, total[1]], abs=1e-6)
    assert client.post("/v1/score", json={**body, "label_normalization": None}).json()["scores"][0] == total


def test_softmax_over_labels_of_several_tokens(client: Client) -> None:
    body = score_body(items=["c"], label_token_ids=[[3, 4], [5, 6, 0]])
    logprobs = client.post("/v1/score", json=body).json()["scores"][0]
    softmax = client.post("/v1/score", json={**body, "apply_softmax": True}).json()["scores"][0]
    exps = [math.exp(v) for v in logprobs]
    assert softmax == pytest.approx([e / sum(exps) for e in exps], abs=1e-6)


def test_token_logprobs_per_item_label_and_token(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body(query=[5], items=[[7], [8, 9]], label_token_ids=[[3, 4], 10],
                                                     return_token_logprobs=True))
    data = reply.json()
    assert list(data) == ["id", "object", "created", "model", "scores", "usage", "token_logprobs"]
    for length, row, scores in zip((2, 3), data["token_logprobs"], data["scores"]):
        assert row[0] == pytest.approx([expected_logprob(length, 3), expected_logprob(length + 1, 4)], abs=1e-6)
        assert row[1] == pytest.approx([expected_logprob(length, 10)], abs=1e-6)
        assert [sum(tokens) for tokens in row] == pytest.approx(scores, abs=1e-5)


def test_token_logprobs_of_one_token_labels(client: Client) -> None:
    data = client.post("/v1/score", json=score_body(return_token_logprobs=True)).json()
    assert data["token_logprobs"] == [[[score] for score in row] for row in data["scores"]]


@pytest.mark.parametrize(("fields", "code", "param"), [
    (dict(label_token_ids=[3, [4, 5, 6, 7, 8, 9, 10, 11, 12]]), "label_too_long", "label_token_ids"),
    (dict(label_token_ids=[[3], []]), "empty_label", "label_token_ids"),
    (dict(label_token_ids=[[3, -1]]), "negative_token_id", "label_token_ids"),
    (dict(label_token_ids=[[3, 1000]]), "token_id_exceeds_vocab", "label_token_ids"),
    (dict(label_token_ids=..., labels=["ok", ""]), "empty_label", "labels"),
    (dict(label_token_ids=..., labels=["a", "b", 3]), "invalid_labels_type", "labels"),
    (dict(label_token_ids=..., labels=["x"] * 17), "too_many_labels", "labels"),
    # null is not a list of strings, and `labels` beside label_token_ids (even null) breaks the schema's oneOf
    (dict(labels=None), "conflicting_labels", "labels"),
    (dict(label_token_ids=..., labels=None), "invalid_labels_type", "labels"),
    (dict(label_token_ids=None, labels=["a"]), "conflicting_labels", "labels"),
])
def test_bad_labels(client: Client, engine: FakeEngine, fields: dict, code: str, param: str) -> None:
    reply = client.post("/v1/score", json=score_body(**fields))
    assert_error(reply, 422 if code == "token_id_exceeds_vocab" else 400, code, param)
    assert not engine.submissions


def test_the_label_limit_names_the_label_and_the_setting(client: Client) -> None:
    reply = client.post("/v1/score", json=score_body(label_token_ids=..., labels=["ok", "much too long"]))
    message = reply.json()["error"]["message"]
    assert "labels[1] ('much too long') has 13 tokens" in message and "SCOREFN_MAX_LABEL_TOKENS" in message
