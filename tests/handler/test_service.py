"""The other endpoints, readiness, API keys, body limits, metrics and the engine's lifecycle, on both faces."""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections.abc import Callable

import pytest

from tests.handler.clients import Client
from tests.handler.conftest import WAIT_S, assert_error, make_settings, score_body, serve
from tests.handler.fake_engine import FakeEngine


def test_health(client: Client) -> None:
    reply = client.get("/health")
    assert reply.status == 200 and reply.json() == {"status": "ok"}


def test_models(client: Client) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and len(data["data"]) == 1
    card = data["data"][0]
    assert card == {"id": "fake-model", "object": "model", "created": card["created"], "owned_by": "scorefn",
                    "batch_invariant": True, "dtype": "float32"}


def test_tokenize(client: Client) -> None:
    assert client.post("/v1/tokenize", json={"text": "hi"}).json() == {"tokens": [104, 105], "count": 2}
    reply = client.post("/v1/tokenize", json={"text": "hi", "add_special_tokens": True, "model": "x"})
    assert reply.json() == {"tokens": [1, 104, 105], "count": 3}
    assert client.post("/v1/tokenize", json={"text": ""}).json() == {"tokens": [], "count": 0}


def test_options(client: Client) -> None:
    reply = client.request("OPTIONS", "/v1/score")
    assert reply.status == 204 and reply.headers["allow"] == "OPTIONS, POST"


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/score", "OPTIONS, POST"),
                                               ("DELETE", "/health", "GET, OPTIONS"),
                                               ("POST", "/v1/models", "GET, OPTIONS")])
def test_method_not_allowed(client: Client, method: str, path: str, allow: str) -> None:
    reply = client.request(method, path)
    assert_error(reply, 405, "method_not_allowed")
    assert reply.headers["allow"] == allow


@pytest.mark.parametrize("path", ["/", "/v1", "/v2/score", "/v1/score/extra", "/%ff", "/v1/sc%C3%B6re"])
def test_not_found(client: Client, path: str) -> None:
    assert_error(client.get(path), 404, "not_found")


@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_ready_503_during_warm_up_then_200(face: str) -> None:
    engine = FakeEngine(gated=True)
    with serve(face, make_settings(), engine, wait_ready=False) as client:
        assert client.get("/health").status == 200
        reply = client.get("/ready")
        assert_error(reply, 503, "server_not_ready")
        assert reply.headers["retry-after"] == "5"
        assert_error(client.post("/v1/score", json=score_body()), 503, "server_not_ready")
        assert_error(client.post("/v1/tokenize", json={"text": "a"}), 503, "server_not_ready")
        assert engine.submissions == []
        engine.start_gate.set()
        assert engine.started.wait(WAIT_S)
        assert client.get("/ready").json() == {"status": "ready"}
        assert client.post("/v1/score", json=score_body()).status == 200
    assert engine.start_calls == 1


def test_asgi_lifespan_stops_the_engine_with_the_grace_period() -> None:
    engine = FakeEngine()
    with serve("asgi", make_settings(drain_grace_s=3.5), engine):
        assert not engine.stopped.is_set()
    assert engine.stopped.is_set() and engine.stop_grace == 3.5


@pytest.mark.parametrize("face", ["asgi", "wsgi"])
def test_an_already_started_engine_is_not_started_again(face: str) -> None:
    engine = FakeEngine()
    engine.start()
    with serve(face, make_settings(), engine) as client:
        assert client.get("/ready").status == 200
    assert engine.start_calls == 1


# -- API keys --------------------------------------------------------------------------------------------

@pytest.fixture
def keyed(face: str, engine: FakeEngine):
    with serve(face, make_settings(api_keys=("k-one", "k-two")), engine) as client:
        yield client


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Bearer wrong", "Basic k-one",
                                           "k-one", "Bearer k-one-and-more", "Bearer k-on"])
def test_api_key_rejected(keyed: Client, authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    for method, path, body in [("POST", "/v1/score", score_body()), ("GET", "/v1/models", None),
                               ("POST", "/v1/tokenize", {"text": "a"}), ("POST", "/v1/classify", {"input": "a"}),
                               *[("POST", path, {"query": "q", "documents": ["d"]})
                                 for path in ("/v1/rerank", "/v2/rerank", "/rerank")]]:
        reply = keyed.request(method, path, json=body, headers=headers)
        assert_error(reply, 401, "invalid_api_key", error_type="authentication_error")
        assert reply.headers["www-authenticate"] == "Bearer"
        assert "k-one" not in reply.body.decode()


@pytest.mark.parametrize("authorization", ["Bearer k-one", "Bearer k-two", "bearer k-one", "BEARER  k-two "])
def test_api_key_accepted(keyed: Client, authorization: str) -> None:
    assert keyed.post("/v1/score", json=score_body(), headers={"authorization": authorization}).status == 200


def test_probes_and_metrics_need_no_key(keyed: Client) -> None:
    assert keyed.get("/health").status == 200
    assert keyed.get("/ready").status == 200
    assert keyed.get("/metrics").status == 200


def test_auth_comes_before_body_checks(keyed: Client) -> None:
    assert_error(keyed.post("/v1/score", content=b"not json"), 401, "invalid_api_key")
    assert_error(keyed.post("/v1/score", content=b" " * (70 * 1024)), 401, "invalid_api_key")


# -- body size -------------------------------------------------------------------------------------------

def test_body_over_the_limit_is_413(client: Client, engine: FakeEngine) -> None:
    limit = 64 * 1024
    padded = score_body(pad="x" * (limit - 200))
    assert client.post("/v1/score", json=padded).status == 200
    body = score_body(pad="x" * limit)
    error = assert_error(client.post("/v1/score", json=body), 413, "request_too_large")
    assert str(limit) in error["message"]
    assert_error(client.post("/v1/tokenize", content=b"{" + b" " * limit + b"}"), 413, "request_too_large")
    assert len(engine.submissions) == 1


def test_body_exactly_at_the_limit_is_read(client: Client) -> None:
    prefix = b'{"query": "ab", "items": ["c"], "label_token_ids": [1]'
    content = prefix + b" " * (64 * 1024 - len(prefix) - 1) + b"}"
    assert len(content) == 64 * 1024
    assert client.post("/v1/score", content=content).status == 200


def test_chunked_body_over_the_limit_is_413(face: str, engine: FakeEngine) -> None:
    big = b'{"pad": "' + b"x" * (70 * 1024) + b'"}'
    with serve(face, make_settings(), engine) as client:
        if face == "wsgi":
            reply = client.request("POST", "/v1/score", content=big, chunked=True)  # type: ignore[call-arg]
            small = client.request("POST", "/v1/score", json=score_body(), chunked=True)  # type: ignore[call-arg]
        else:
            test_client = client._client  # type: ignore[attr-defined]
            raw = test_client.post("/v1/score", content=iter([big[:1000], big[1000:]]))
            from tests.handler.clients import Reply
            reply = Reply(raw.status_code, dict(raw.headers), raw.content)
            ok = test_client.post("/v1/score", content=iter([b"{", b'"query": "a", "items": ["b"], '
                                                                   b'"label_token_ids": [1]}']))
            small = Reply(ok.status_code, dict(ok.headers), ok.content)
    assert_error(reply, 413, "request_too_large")
    assert small.status == 200


def test_wsgi_invalid_content_length_is_400() -> None:
    from handler.wsgi import create_wsgi_app
    from tests.handler.clients import WsgiClient

    engine = FakeEngine()
    app = create_wsgi_app(make_settings(), engine)
    assert engine.started.wait(WAIT_S)
    client = WsgiClient(app, validate=False)
    for value in ("abc", "-5"):
        reply = client.post("/v1/score", json=score_body(), headers={"content-length": value})
        assert_error(reply, 400, "invalid_request")


def test_asgi_invalid_content_length_is_400() -> None:
    import asyncio

    from handler.asgi import create_app

    app = create_app(make_settings(), FakeEngine())
    messages: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/score", "raw_path": b"/v1/score", "query_string": b"",
             "root_path": "", "headers": [(b"content-length", b"abc")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "state": {}}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        messages.append(message)

    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert messages[0]["status"] == 400
    import json
    assert json.loads(messages[1]["body"])["error"]["code"] == "invalid_request"


# -- the engine's verdicts -------------------------------------------------------------------------------

def _resolve_held(engine: FakeEngine, action: Callable[[concurrent.futures.Future], None]) -> threading.Thread:
    def run() -> None:
        assert engine.submitted.wait(WAIT_S)
        action(engine.held[0])

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_waits_for_a_pending_result(client: Client, engine: FakeEngine) -> None:
    engine.hold = True
    thread = _resolve_held(engine, lambda f: f.set_result(FakeEngine.compute([[1, 2, 3]], [6])))
    reply = client.post("/v1/score", json=score_body(query=[1, 2], items=[[3]], label_token_ids=[6]))
    thread.join()
    assert reply.status == 200 and reply.json()["scores"] == [pytest.approx([-6.03])]


def test_future_cancelled_by_the_engine_is_503(client: Client, engine: FakeEngine) -> None:
    engine.hold = True
    thread = _resolve_held(engine, lambda f: f.cancel())
    reply = client.post("/v1/score", json=score_body())
    thread.join()
    assert_error(reply, 503, "server_not_ready")


def test_result_of_the_wrong_shape_is_a_500(client: Client, engine: FakeEngine) -> None:
    engine.hold = True
    thread = _resolve_held(engine, lambda f: f.set_result(FakeEngine.compute([[1]], [1])))
    reply = client.post("/v1/score", json=score_body(items=["a", "b"]))
    thread.join()
    assert_error(reply, 500, "internal_error")


def test_big_requests_are_served_off_the_event_loop_too(face: str, engine: FakeEngine) -> None:
    settings = make_settings(max_labels=4096, max_body_bytes=1 << 20)
    labels = list(range(1000)) * 4
    with serve(face, settings, engine) as client:
        reply = client.post("/v1/score", json=score_body(items=["a"] * 8, label_token_ids=labels, pad="x" * 70_000))
    assert reply.status == 200
    assert len(reply.json()["scores"]) == 8 and len(reply.json()["scores"][0]) == 4000


# -- metrics ---------------------------------------------------------------------------------------------

def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in metrics"
    return float(match.group(1))


def test_metrics(client: Client) -> None:
    client.post("/v1/score", json=score_body(items=["a", "b", "c"]))
    client.post("/v1/score", json=score_body(items=[]))
    client.get("/nowhere")
    reply = client.get("/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.body.decode()
    assert _sample(text, 'scorefn_requests_total{endpoint="/v1/score",status="200"}') == 1
    assert _sample(text, 'scorefn_requests_total{endpoint="/v1/score",status="400"}') == 1
    assert _sample(text, 'scorefn_requests_total{endpoint="unmatched",status="404"}') == 1
    assert _sample(text, 'scorefn_request_duration_seconds_count{endpoint="/v1/score"}') == 2
    assert _sample(text, "scorefn_items_scored_total") == 3
    assert _sample(text, "scorefn_tokens_scored_total") == 3 * 4
    assert _sample(text, "scorefn_queue_seconds_sum") == 0.25
    assert _sample(text, "scorefn_device_seconds_sum") == 0.5
    assert _sample(text, "scorefn_engine_compiles_total") == 12
    assert _sample(text, "scorefn_engine_queue_depth") == 0
    assert _sample(text, "scorefn_engine_device_batches_total") == 1
    assert _sample(text, "scorefn_engine_device_batch_sequences_total") == 3
    assert _sample(text, "scorefn_engine_predicted_wait_seconds") == 0.75
    assert _sample(text, "scorefn_engine_load") == 0.4  # the autoscaling signal
    assert _sample(text, "scorefn_engine_refused_wait_total") == 3
    assert _sample(text, 'scorefn_engine_service_tokens_per_second{kind="full"}') == 900
    assert _sample(text, "scorefn_engine_service_batch_overlap") == 0.88
    assert "# TYPE scorefn_engine_predicted_wait_seconds gauge" in text
    assert 'scorefn_items_per_request_bucket{le="4.0"} 1.0' in text
    assert _sample(text, 'scorefn_platform_info{backend="cpu",batch_invariant="true",dtype="float32"}') == 1


def test_each_app_has_its_own_registry(face: str) -> None:
    first, second = FakeEngine(), FakeEngine()
    with serve(face, make_settings(), first) as a, serve(face, make_settings(), second) as b:
        a.post("/v1/score", json=score_body())
        assert _sample(a.get("/metrics").body.decode(), "scorefn_items_scored_total") == 2
        assert _sample(b.get("/metrics").body.decode(), "scorefn_items_scored_total") == 0


def test_metrics_survive_an_engine_whose_stats_fail(client: Client, engine: FakeEngine) -> None:
    def broken() -> dict[str, float]:
        raise RuntimeError("stats unavailable")

    engine.stats = broken  # type: ignore[method-assign]
    reply = client.get("/metrics")
    assert reply.status == 200 and "scorefn_engine_" not in reply.body.decode()
