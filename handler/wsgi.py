"""The WSGI face: a plain WSGI callable over handler.core, for hosts without ASGI.

Serve with `granian --interface wsgi handler.wsgi:application` or `gunicorn handler.wsgi:application`.
WSGI has no lifespan, so warm-up starts in a background thread when the app is built and again in any
forked worker on its first request; /ready answers 503 until it is done. Each request thread blocks on
its engine future; the engine's own device thread does the work.
"""

from __future__ import annotations

import atexit
import http
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from handler.core import ScoringCore
from runtime.interface import ScoringEngine
from handler.errors import ERRORS
from handler.http import HttpRequest, HttpResponse, PendingScore
from handler.lifecycle import BackgroundWarmup, shut_down
from handler.logs import configure_logging
from runtime.settings import Settings, load_settings

log = logging.getLogger("scorefn.handler")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class WsgiApp:
    def __init__(self, core: ScoringCore, owns_process: bool = False) -> None:
        self.core = core
        self.warmup = BackgroundWarmup(core, owns_process)
        self.warmup.ensure_started()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        self.warmup.ensure_started()
        started = time.perf_counter()
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        path = _path(environ)
        headers = _headers(environ)
        try:
            body = _read_body(environ, method, self.core.settings.max_body_bytes)
        except ValueError:
            error = ERRORS.bad_content_length(value=environ.get("CONTENT_LENGTH", "")[:32])
            return _send(self.core.reject(HttpRequest(method, path, headers, b"", started), error), start_response)
        except OSError:  # the client went away mid-body; whatever we answer, nobody reads it
            log.info("request body unreadable on %s %s", method, path, exc_info=True)
            error = ERRORS.body_unreadable()
            return _send(self.core.reject(HttpRequest(method, path, headers, b"", started), error), start_response)
        outcome = self.core.begin(HttpRequest(method, path, headers, body, started))
        if isinstance(outcome, PendingScore):
            try:
                result = outcome.future.result()
            except Exception as exc:  # the engine's verdict (CancelledError included); the core maps it
                result = exc
            outcome = self.core.finish(outcome, result)
        return _send(outcome, start_response)


def create_wsgi_app(settings: Settings | None = None, engine: ScoringEngine | None = None, *,
                    owns_process: bool = False) -> WsgiApp:
    """The app; without an engine, warm-up builds one with runtime.engine.build_engine(settings).

    `owns_process` (the served module-level `application`): a failed engine start ends the process.
    """
    return WsgiApp(ScoringCore(settings or load_settings(), engine), owns_process=owns_process)


def _path(environ: dict[str, Any]) -> str:
    # PEP 3333 hands the path over as latin-1-decoded bytes; clients send UTF-8, which Litestar decodes too.
    path = environ.get("PATH_INFO", "")
    try:
        path = path.encode("latin-1").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a server that already decoded it as UTF-8
        pass
    return path or "/"


def _headers(environ: dict[str, Any]) -> dict[str, str]:
    headers = {key[5:].replace("_", "-").lower(): value for key, value in environ.items() if key.startswith("HTTP_")}
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            headers[key.replace("_", "-").lower()] = environ[key]
    return headers


def _read_body(environ: dict[str, Any], method: str, limit: int) -> bytes | None:
    """The body, or None when it is larger than `limit` (then it is not read). ValueError: bad Content-Length."""
    if method != "POST":
        return b""
    stream = environ["wsgi.input"]
    declared = environ.get("CONTENT_LENGTH", "")
    if declared:
        length = int(declared)
        if length < 0:
            raise ValueError(declared)
        return None if length > limit else stream.read(length)
    if environ.get("wsgi.input_terminated"):  # chunked upload the server ends for us: read up to the limit
        body = stream.read(limit + 1)
        return None if len(body) > limit else body
    return b""  # PEP 3333: no Content-Length means no body


def _send(response: HttpResponse, start_response: StartResponse) -> list[bytes]:
    status = f"{response.status} {http.HTTPStatus(response.status).phrase}"
    start_response(status, [*response.headers, ("content-length", str(len(response.body)))])
    return [response.body]


def __getattr__(name: str) -> Any:
    # Built on first access (by the server), not at import; see handler.asgi for why.
    if name == "application":
        settings = load_settings()
        configure_logging(level=settings.log_level)
        built = create_wsgi_app(settings, owns_process=True)
        atexit.register(shut_down, built.core)  # no lifespan: drain when the worker process exits
        globals()["application"] = built
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
