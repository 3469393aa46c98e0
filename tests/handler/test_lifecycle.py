"""How each face gets and warms up its engine, and the module-level apps that servers import."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import types
from collections.abc import Iterator

import pytest

import handler.asgi
import handler.wsgi
from handler.logs import configure_logging, log_access
from runtime.settings import Settings
from tests.handler.conftest import WAIT_S, make_settings, score_body
from tests.handler.fake_engine import FakeEngine


class BuiltEngines(list):
    def __init__(self) -> None:
        super().__init__()
        self.built = threading.Event()


@pytest.fixture
def built_engines(monkeypatch: pytest.MonkeyPatch) -> BuiltEngines:
    """Stands in for runtime.engine (which imports JAX): build_engine(settings) returns a FakeEngine."""
    engines = BuiltEngines()

    def build_engine(settings: Settings) -> FakeEngine:
        assert isinstance(settings, Settings)
        engines.append(FakeEngine())
        engines.built.set()
        return engines[-1]

    module = types.ModuleType("runtime.engine")
    module.build_engine = build_engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "runtime.engine", module)
    return engines


@pytest.fixture
def scorefn_logger() -> Iterator[logging.Logger]:
    """Restores the `scorefn` logger after a test that configures it."""
    logger = logging.getLogger("scorefn")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_asgi_builds_its_engine_in_the_lifespan(built_engines: BuiltEngines,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from litestar.testing import TestClient

    caplog.set_level(logging.INFO, logger="scorefn")
    app = handler.asgi.create_app(make_settings())
    assert built_engines == []  # nothing heavy at construction
    with TestClient(app) as client:
        assert built_engines.built.wait(WAIT_S)  # built and started in a worker thread
        assert built_engines[0].started.wait(WAIT_S)
        assert client.get("/ready").status_code == 200
        assert client.post("/v1/score", json=score_body()).status_code == 200
    assert built_engines[0].stopped.is_set()
    assert any(r.getMessage() == "ready" for r in caplog.records if r.name == "scorefn.handler")


def test_wsgi_builds_and_starts_its_engine_once(built_engines: BuiltEngines) -> None:
    app = handler.wsgi.create_wsgi_app(make_settings())
    assert app.warmup.thread is not None
    app.warmup.thread.join(WAIT_S)
    assert len(built_engines) == 1 and built_engines[0].start_calls == 1
    thread = app.warmup.thread
    app.warmup.ensure_started()  # every request calls it; same process: nothing new
    assert app.warmup.thread is thread and built_engines[0].start_calls == 1


def test_a_failed_start_leaves_health_up_and_ready_down(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from tests.handler.clients import WsgiClient

    def build_engine(settings: Settings) -> FakeEngine:
        raise OSError("weights not found")

    module = types.ModuleType("runtime.engine")
    module.build_engine = build_engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "runtime.engine", module)
    app = handler.wsgi.create_wsgi_app(make_settings())
    assert app.warmup.thread is not None
    app.warmup.thread.join(WAIT_S)
    client = WsgiClient(app)
    assert client.get("/health").status == 200
    assert client.get("/ready").status == 503
    assert any("engine start failed" in r.getMessage() and r.exc_info for r in caplog.records)


class Exited(Exception):
    pass


def test_a_failed_start_of_a_served_app_exits_the_process(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The served apps own their process: the cause is logged once, CRITICAL with the traceback, then it exits 3."""
    from handler import lifecycle
    from handler.core import ScoringCore

    def build_engine(settings: Settings) -> FakeEngine:
        raise ImportError("apply_chat_template requires jinja2 to be installed.")

    def exit_now(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr(lifecycle, "build_engine", build_engine)
    monkeypatch.setattr(lifecycle.os, "_exit", exit_now)
    with pytest.raises(Exited) as exited:
        lifecycle.warm_up(ScoringCore(make_settings()), owns_process=True)
    assert exited.value.args == (lifecycle.EXIT_START_FAILED,)
    (record,) = [r for r in caplog.records if "engine start failed" in r.getMessage()]
    assert record.levelno == logging.CRITICAL and record.exc_info
    assert record.getMessage() == ("engine start failed, exiting: ImportError: "
                                   "apply_chat_template requires jinja2 to be installed.")


def test_module_level_asgi_app(monkeypatch: pytest.MonkeyPatch, scorefn_logger: logging.Logger) -> None:
    monkeypatch.delitem(vars(handler.asgi), "app", raising=False)
    monkeypatch.setenv("SCOREFN_MAX_ITEMS", "3")
    app = handler.asgi.app  # what `granian --interface asgi handler.asgi:app` does
    assert app is handler.asgi.app
    assert app.state.core.settings.max_items == 3 and app.state.core.engine is None
    monkeypatch.delitem(vars(handler.asgi), "app")
    with pytest.raises(AttributeError):
        handler.asgi.no_such_thing  # noqa: B018


def test_module_level_wsgi_application(built_engines: BuiltEngines, monkeypatch: pytest.MonkeyPatch,
                                       scorefn_logger: logging.Logger) -> None:
    import atexit

    registered: list = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append((fn, args)))
    monkeypatch.delitem(vars(handler.wsgi), "application", raising=False)
    application = handler.wsgi.application
    monkeypatch.delitem(vars(handler.wsgi), "application")
    assert application.warmup.thread is not None
    application.warmup.thread.join(WAIT_S)
    assert built_engines[0].ready
    fn, args = registered[0]
    fn(*args)  # what happens at process exit: drain, then stop
    assert built_engines[0].stopped.is_set()


def test_configure_logging_writes_json_lines(scorefn_logger: logging.Logger) -> None:
    stream = io.StringIO()
    configure_logging(stream)
    configure_logging(stream)  # idempotent
    log_access(request_id="r1", method="POST", path="/v1/score", status=503, total_seconds=0.0123, items=2)
    logging.getLogger("scorefn.handler").info("ready")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    access, ready = lines
    assert access["severity"] == "ERROR" and access["logger"] == "scorefn.access"
    assert access["message"] == "POST /v1/score 503" and access["request_id"] == "r1" and access["items"] == 2
    assert access["httpRequest"] == {"requestMethod": "POST", "requestUrl": "/v1/score", "status": 503,
                                     "latency": "0.012300s"}
    assert "tokens" not in access  # unknown fields are left out, not null
    assert ready == {"severity": "INFO", "message": "ready", "logger": "scorefn.handler"}
