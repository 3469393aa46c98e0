"""Fixtures: a fake engine, small limits, and a `client` parametrized over both faces (ASGI and WSGI)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from handler.asgi import create_app
from handler.wsgi import create_wsgi_app
from runtime.settings import Settings, load_settings
from tests.handler.clients import AsgiClient, Client, WsgiClient
from tests.handler.fake_engine import FakeEngine

FACES = ("asgi", "wsgi")
WAIT_S = 10.0  # upper bound for a background warm-up to finish (polled via an Event, not slept)

# Small limits so that tests can cross them cheaply.
LIMITS = dict(max_items=8, max_labels=16, max_total_tokens=300, max_body_bytes=64 * 1024, max_queue=4)


def make_settings(**overrides: Any) -> Settings:
    return load_settings(environ={}, **{**LIMITS, **overrides})


@contextlib.contextmanager
def serve(face: str, settings: Settings, engine: FakeEngine, *, wait_ready: bool = True) -> Iterator[Client]:
    """A client for the face, its app started (lifespan / warm-up thread) and, unless told, ready."""
    if face == "asgi":
        with TestClient(create_app(settings, engine)) as test_client:
            try:
                if wait_ready:
                    assert engine.started.wait(WAIT_S)
                yield AsgiClient(test_client)
            finally:
                engine.start_gate.set()  # a gated warm-up must end before the lifespan can shut down
    else:
        app = create_wsgi_app(settings, engine)
        try:
            if wait_ready:
                assert engine.started.wait(WAIT_S)
            yield WsgiClient(app)
        finally:
            engine.start_gate.set()
            assert app.warmup.thread is not None
            app.warmup.thread.join(WAIT_S)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> Settings:
    return make_settings()


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def client(face: str, settings: Settings, engine: FakeEngine) -> Iterator[Client]:
    with serve(face, settings, engine) as c:
        yield c


def score_body(**fields: Any) -> dict[str, Any]:
    """A valid text-mode request, with fields replaced (a value of ... removes the field)."""
    body: dict[str, Any] = {"query": "ab", "items": ["c", "de"], "label_token_ids": [3, 10]}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not ...}


def assert_error(reply: Any, status: int, code: str, param: str | None = None, error_type: str | None = None) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    envelope = reply.json()
    assert set(envelope) == {"error"}
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["param"] == param, error
    if error_type is not None:
        assert error["type"] == error_type, error
    assert isinstance(error["message"], str) and error["message"]
    return error
