"""One suite, both faces: the ASGI (Litestar) and WSGI apps answer every request with the same status,
the same JSON body (less the per-response id and timestamp) and the same protocol headers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.handler.clients import Client, Reply
from tests.handler.conftest import make_settings, score_body, serve
from tests.handler.fake_engine import FakeEngine
from tests.handler.test_strictness import MALFORMED
from tests.handler.test_validation import ORDER_CASES, RFC_006_ROWS

KEY = {"authorization": "Bearer parity-key"}
_COMPARED_HEADERS = ("content-type", "retry-after", "allow", "www-authenticate")

# (method, path, json body or raw bytes, headers)
CASES: list[tuple[str, str, Any, dict[str, str]]] = [
    ("GET", "/health", None, {}),
    ("GET", "/ready", None, {}),
    ("GET", "/v1/models", None, KEY),
    ("GET", "/v1/models", None, {}),
    ("POST", "/v1/tokenize", {"text": "héllo wörld", "add_special_tokens": True}, KEY),
    ("POST", "/v1/tokenize", {"text": 5}, KEY),
    ("POST", "/v1/score", score_body(), KEY),
    ("POST", "/v1/score", score_body(), {"authorization": "Bearer nope"}),
    ("POST", "/v1/score", score_body(apply_softmax=True, item_first=True, label_token_ids=[1, 2, 2, 9]), KEY),
    ("POST", "/v1/score", score_body(query=[4, 5], items=[[6], [], [7, 8]], label_token_ids=[0, 999]), KEY),
    ("POST", "/v1/score", score_body(query="x" * 80), KEY),
    ("POST", "/v1/score", b"{" + b" " * (64 * 1024) + b"}", KEY),
    ("GET", "/v1/score", None, KEY),
    ("PUT", "/v1/tokenize", None, KEY),
    ("GET", "/nothing/here", None, {}),
    ("OPTIONS", "/v1/score", None, {}),
    *[("POST", "/v1/score", score_body(**fields), KEY) for fields, *_ in RFC_006_ROWS],
    *[("POST", "/v1/score", score_body(**fields), KEY) for fields, _ in ORDER_CASES],
    *[("POST", "/v1/score", content, KEY) for content, _ in MALFORMED.values()],
]


@pytest.fixture(scope="module")
def faces() -> Iterator[tuple[Client, Client]]:
    settings = make_settings(api_keys=("parity-key",))
    with serve("asgi", settings, FakeEngine()) as asgi, serve("wsgi", settings, FakeEngine()) as wsgi:
        yield asgi, wsgi


def _comparable(reply: Reply) -> tuple[int, Any, dict[str, str]]:
    body: Any = reply.body
    if reply.headers.get("content-type", "").startswith("application/json"):
        body = reply.json()
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("id", "created")}
            if body.get("object") == "list":
                body["data"] = [{k: v for k, v in card.items() if k != "created"} for card in body["data"]]
    return reply.status, body, {name: reply.headers[name] for name in _COMPARED_HEADERS if name in reply.headers}


@pytest.mark.parametrize("method,path,body,headers", CASES, ids=[f"{i}-{c[0]}-{c[1]}" for i, c in enumerate(CASES)])
def test_both_faces_answer_alike(faces: tuple[Client, Client], method: str, path: str, body: Any,
                                 headers: dict[str, str]) -> None:
    kwargs: dict[str, Any] = {"headers": headers}
    kwargs["content" if isinstance(body, bytes) else "json"] = body
    asgi, wsgi = (client.request(method, path, **kwargs) for client in faces)
    assert _comparable(asgi) == _comparable(wsgi)
    if method == "POST" and path == "/v1/score":
        for reply in (asgi, wsgi):
            assert {"x-request-id", "x-total-time"} <= set(reply.headers)
