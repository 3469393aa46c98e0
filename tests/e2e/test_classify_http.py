"""/v1/classify through real HTTP on the embedded model: the built-in sentiment classifier, the OpenAI client."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_builtin_sentiment_classifier(server):
    body = {"input": ["I absolutely loved this movie, it was wonderful!",
                      "This movie was absolutely terrible and boring."]}
    response = httpx.post(server.url + "/v1/classify", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["model"] == "sentiment" and result["object"] == "list"
    assert [(d["index"], d["label"], d["num_classes"]) for d in result["data"]] == [(0, "positive", 2),
                                                                                   (1, "negative", 2)]
    assert "x-device-time" in response.headers
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert {"id": "sentiment", "labels": ["positive", "negative"]}.items() <= models[1].items()


def test_openai_client_maps_classify_errors(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:  # closed: no stray socket
        result = client.post("/classify", body={"model": "sentiment", "input": "Great, I love it!"}, cast_to=object)
        assert result["data"][0]["label"] == "positive"
        with pytest.raises(openai.BadRequestError) as caught:
            client.post("/classify", body={"input": "   "}, cast_to=object)
        assert caught.value.code == "empty_input"
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            client.post("/classify", body={"input": [1, 10**6]}, cast_to=object)
        assert caught.value.code == "token_id_exceeds_vocab"
