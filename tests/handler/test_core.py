"""The framework-free core on its own: begin/finish, draining, and the access log it writes."""

from __future__ import annotations

import json
import logging

import pytest

from handler.core import ScoringCore
from runtime.interface import DeadlineExceeded
from handler.http import HttpRequest, HttpResponse, PendingScore
from tests.handler.conftest import make_settings, score_body
from tests.handler.fake_engine import FakeEngine


def _request(method: str, path: str, body: dict | None = None, **headers: str) -> HttpRequest:
    return HttpRequest(method, path, headers, b"" if body is None else json.dumps(body).encode())


@pytest.fixture
def core() -> ScoringCore:
    engine = FakeEngine()
    engine.start()
    return ScoringCore(make_settings(), engine)


def test_begin_then_finish(core: ScoringCore) -> None:
    assert isinstance(core.engine, FakeEngine)
    core.engine.hold = True
    pending = core.begin(_request("POST", "/v1/score", score_body()))
    assert isinstance(pending, PendingScore) and not pending.future.done()
    response = core.finish(pending, FakeEngine.compute(pending.job.sequences, pending.job.label_ids))
    assert isinstance(response, HttpResponse) and response.status == 200
    assert json.loads(response.body)["usage"]["total_tokens"] == 9


def test_finish_with_an_exception(core: ScoringCore) -> None:
    pending = core.begin(_request("POST", "/v1/score", score_body()))
    assert isinstance(pending, PendingScore)
    response = core.finish(pending, DeadlineExceeded())
    assert response.status == 503 and json.loads(response.body)["error"]["code"] == "request_timeout"
    assert ("retry-after", "1") in response.headers


def test_everything_else_is_answered_by_begin(core: ScoringCore) -> None:
    for request, status in [(_request("GET", "/health"), 200), (_request("POST", "/v1/score", {}), 400),
                            (_request("GET", "/v1/x"), 404)]:
        response = core.begin(request)
        assert isinstance(response, HttpResponse) and response.status == status


def test_draining_turns_ready_off_and_refuses_work(core: ScoringCore) -> None:
    assert core.begin(_request("GET", "/ready")).status == 200  # type: ignore[union-attr]
    core.start_draining()
    for request in (_request("GET", "/ready"), _request("POST", "/v1/score", score_body())):
        response = core.begin(request)
        assert isinstance(response, HttpResponse) and response.status == 503
        assert json.loads(response.body)["error"]["code"] == "server_not_ready"
    assert core.begin(_request("GET", "/health")).status == 200  # type: ignore[union-attr]


def test_no_engine_yet(core: ScoringCore) -> None:
    core.engine = None
    for path in ("/ready", "/v1/models"):
        assert core.begin(_request("GET", path)).status == 503  # type: ignore[union-attr]
    assert core.begin(_request("GET", "/metrics")).status == 200  # type: ignore[union-attr]


def test_access_log(core: ScoringCore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="scorefn.access")
    secret = "my private query text"
    pending = core.begin(_request("POST", "/v1/score", score_body(query=secret), **{"x-request-id": "req-1"}))
    assert isinstance(pending, PendingScore)
    core.finish(pending, pending.future.result())
    core.begin(_request("POST", "/v1/score", score_body(items=[])))
    core.begin(_request("GET", "/health"))
    records = [r for r in caplog.records if r.name == "scorefn.access"]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING, logging.DEBUG]
    fields = records[0].json_fields  # type: ignore[attr-defined]
    assert fields["request_id"] == "req-1" and fields["method"] == "POST" and fields["path"] == "/v1/score"
    assert fields["status"] == 200 and fields["items"] == 2 and fields["tokens"] == 2 * (1 + len(secret)) + len("c" + "de")
    assert fields["queue_s"] == 0.25 and fields["device_s"] == 0.5 and fields["total_s"] >= 0
    assert fields["httpRequest"]["status"] == 200 and fields["httpRequest"]["latency"].endswith("s")
    assert records[1].json_fields["status"] == 400  # type: ignore[attr-defined]
    assert all(secret not in r.getMessage() and secret not in json.dumps(r.json_fields) for r in records)


def test_probes_answered_503_are_not_errors(core: ScoringCore, caplog: pytest.LogCaptureFixture) -> None:
    """Warming up or draining, /ready says 503 on every probe: expected, so DEBUG; a 503 on /v1/* stays ERROR."""
    caplog.set_level(logging.DEBUG, logger="scorefn.access")
    core.start_draining()
    assert core.begin(_request("GET", "/ready")).status == 503  # type: ignore[union-attr]
    assert core.begin(_request("POST", "/v1/score", score_body())).status == 503  # type: ignore[union-attr]
    records = [r for r in caplog.records if r.name == "scorefn.access"]
    assert [(r.getMessage(), r.levelno) for r in records] == [("GET /ready 503", logging.DEBUG),
                                                              ("POST /v1/score 503", logging.ERROR)]


def test_request_bodies_are_logged_only_when_asked(core: ScoringCore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="scorefn.handler")
    core.begin(_request("POST", "/v1/score", score_body(query="not logged")))
    core.settings = core.settings.replace(log_requests_debug=True)
    core.begin(_request("POST", "/v1/score", score_body(query="logged"), **{"x-request-id": "req-9"}))
    (record,) = [r for r in caplog.records if r.getMessage() == "request req-9 body"]
    assert '"query":"logged"' in record.json_fields["body"].replace(" ", "")  # type: ignore[attr-defined]
    assert not any("not logged" in json.dumps(getattr(r, "json_fields", {})) for r in caplog.records)
