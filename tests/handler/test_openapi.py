"""Litestar's OpenAPI schema documents the structs the core reads and writes; the docs page is served."""

from __future__ import annotations

import pytest

from handler.schemas import ScoreRequest, openapi_schema
from tests.handler.conftest import make_settings, serve
from tests.handler.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def spec() -> dict:
    with serve("asgi", make_settings(), FakeEngine()) as client:
        reply = client.get("/schema/openapi.json")
        assert reply.status == 200
        assert client.get("/schema").status == 200  # the docs page
        return reply.json()


def test_every_endpoint_is_documented(spec: dict) -> None:
    assert set(spec["paths"]) == {"/v1/score", "/v1/classify", "/v1/rerank", "/v2/rerank", "/rerank",
                                  "/v1/completions", "/v1/tokenize", "/v1/models", "/health", "/ready", "/metrics"}
    assert "post" in spec["paths"]["/v1/score"] and "get" in spec["paths"]["/v1/models"]


def test_score_request_and_responses(spec: dict) -> None:
    operation = spec["paths"]["/v1/score"]["post"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]
    assert request["required"] == ["query", "items"]
    assert request["oneOf"] == [{"required": ["label_token_ids"]}, {"required": ["labels"]}]
    assert set(request["properties"]) == {"query", "items", "label_token_ids", "labels", "label_normalization",
                                          "return_token_logprobs", "apply_softmax", "item_first", "model",
                                          "cache_salt"}
    assert request["properties"]["apply_softmax"]["type"] == ["boolean", "null"]  # null: as if absent
    assert {"type": "string", "minLength": 1} in request["properties"]["query"]["anyOf"]
    assert set(operation["responses"]) == {"200", "400", "401", "413", "422", "429", "500", "503"}
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(ok["required"]) >= {"id", "created", "model", "scores", "usage"}
    assert ok["properties"]["usage"]["properties"]["completion_tokens"]["default"] == 0  # inlined struct
    assert set(operation["responses"]["200"]["headers"]) == {"x-request-id", "x-queue-time", "x-device-time",
                                                             "x-total-time"}
    error = operation["responses"]["422"]["content"]["application/json"]["schema"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    assert "token_id_exceeds_vocab" in operation["responses"]["422"]["description"]


def test_schema_has_no_dangling_references(spec: dict) -> None:
    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    components = spec.get("components", {}).get("schemas", {})
    for ref in refs(spec["paths"]):
        assert ref.removeprefix("#/components/schemas/") in components, ref


def test_openapi_schema_is_self_contained() -> None:
    assert "$ref" not in str(openapi_schema(ScoreRequest))


def test_completions_request_and_response(spec: dict) -> None:
    operation = spec["paths"]["/v1/completions"]["post"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]
    assert request["required"] == ["prompt", "max_tokens"]
    assert request["properties"]["max_tokens"]["maximum"] == 1 and request["properties"]["logprobs"]["maximum"] == 20
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    choice = ok["properties"]["choices"]["items"]
    assert set(choice["required"]) == {"index", "text", "finish_reason", "logprobs"}
    assert "x-device-time" in operation["responses"]["200"]["headers"]
    assert "generation_not_supported" in operation["responses"]["400"]["description"]
