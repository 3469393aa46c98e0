"""Labels of several tokens through real HTTP (a plain client) on the embedded model, against transformers' sum of
the label tokens' log-probabilities after the prompt."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.runtime.model.test_label_tokens import torch_label_sums

pytestmark = pytest.mark.slow
PARIS = 7042


def post(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/score", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_answer_texts_score_like_transformers(server, torch_embedded):
    model, tokenizer = torch_embedded
    query, items = "Question: What is the capital of Argentina?\nAnswer:", ["", " It is"]
    texts = [" Paris", " Buenos Aires", " Santiago de Chile"]
    labels = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert max(len(label) for label in labels) > 1
    body = post(server, query=query, items=items, labels=texts, return_token_logprobs=True)
    expected = torch_label_sums(model, [tokenizer.encode(query + item) for item in items], labels)
    np.testing.assert_allclose(body["scores"], expected, atol=1e-4, rtol=0)
    assert [[len(tokens) for tokens in row] for row in body["token_logprobs"]] == [[len(l) for l in labels]] * 2
    np.testing.assert_allclose([[sum(tokens) for tokens in row] for row in body["token_logprobs"]], body["scores"],
                               atol=1e-5, rtol=0)
    # The same labels as token-ID lists; per token; as probabilities over the labels.
    assert post(server, query=query, items=items, label_token_ids=labels)["scores"] == body["scores"]
    mean = post(server, query=query, items=items, labels=texts, label_normalization="mean")["scores"]
    np.testing.assert_allclose(mean, expected / [len(label) for label in labels], atol=1e-4, rtol=0)
    probs = np.asarray(post(server, query=query, items=items, labels=texts, apply_softmax=True)["scores"])
    np.testing.assert_allclose(probs, np.exp(expected) / np.exp(expected).sum(axis=1, keepdims=True), atol=1e-4)


def test_one_token_labels_answer_as_before_and_mix_with_longer_ones(server):
    query = "The capital of France is"
    single = post(server, query=query, items=["", " the city of"], label_token_ids=[PARIS, 11])["scores"]
    mixed = post(server, query=query, items=["", " the city of"], label_token_ids=[PARIS, [11, 12], [11]])["scores"]
    assert [row[0] for row in mixed] == [row[0] for row in single]
    assert [row[2] for row in mixed] == [row[1] for row in single]


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"label_token_ids": [[]]}, 400, "empty_label"),
    ({"label_token_ids": [[1] * 9]}, 400, "label_too_long"),
    ({"label_token_ids": [[1, 49152]]}, 422, "token_id_exceeds_vocab"),
    ({"labels": [" a"], "label_token_ids": [1]}, 400, "conflicting_labels"),
    ({"labels": [" a"], "query": [1, 2], "items": [[3]]}, 400, "labels_need_text"),
])
def test_bad_labels_get_their_error(server, body, status, code):
    response = httpx.post(server.url + "/v1/score", json={"query": "x", "items": [""], **body}, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
