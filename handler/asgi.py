"""The ASGI face: a Litestar app whose routes hand raw bytes to handler.core and return its answer as is.

Serve with `granian --interface asgi handler.asgi:app` (or `--factory handler.asgi:create_app`).
The lifespan warms the engine up in a worker thread, so /health answers and /ready says 503 meanwhile;
on SIGTERM (or shutdown) it drains (/ready 503) and stops the engine within drain_grace_s.
Litestar keeps the OpenAPI schema and docs under /schema; every error, its own 404/405 included, is
answered with the RFC-006 envelope.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException, MethodNotAllowedException, NotFoundException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import (OpenAPIHeader, OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation,
                                   RequestBody, Schema)

from handler import schemas
from handler.core import ENDPOINTS, Endpoint, ScoringCore
from runtime.interface import ScoringEngine
from handler.errors import ERRORS
from handler.http import JSON, HttpRequest, HttpResponse, PendingScore
from handler.lifecycle import Drain, warm_up
from handler.logs import configure_logging
from runtime.settings import Settings, load_settings

log = logging.getLogger("scorefn.handler")

# Bigger requests are decoded/tokenized and their responses built in a worker thread, keeping the loop free.
_INLINE_BODY_BYTES = 64 * 1024
_INLINE_TOKENS = 8 * 1024  # of a job: its response (scores, or per-token log-probabilities) is built off the loop
# After the drain, how long shutdown waits for the answers it produced to be sent (granian kills at grace + 5 s).
_SEND_AFTER_DRAIN_S = 4.0


def create_app(settings: Settings | None = None, engine: ScoringEngine | None = None, *,
               owns_process: bool = False) -> Litestar:
    """The app; without an engine, the lifespan builds one with runtime.engine.build_engine(settings).

    `owns_process` (the served module-level `app`): the lifespan hooks SIGTERM (chaining the server's handler)
    to start draining at once, and a failed engine start ends the process. Apps built in tests leave the
    process's signals alone and keep running with /ready 503.
    """
    settings = settings or load_settings()
    core = ScoringCore(settings, engine)
    drain = Drain(core)
    in_flight = InFlight()

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if owns_process and not drain.on_sigterm():
            log.warning("could not hook SIGTERM; draining starts when the server shuts the app down")
        warmup = asyncio.create_task(asyncio.to_thread(warm_up, core, owns_process))
        in_flight.bind()
        try:
            yield
        finally:
            await asyncio.to_thread(drain)
            # The engine has answered everything it will; keep the event loop running until those answers are
            # sent (granian 2.8 runs this shutdown at once on SIGTERM and stops the loop when it returns).
            await in_flight.idle(_SEND_AFTER_DRAIN_S)
            warmup.cancel()  # if still running, its thread finishes on its own; nothing waits for it
            with contextlib.suppress(asyncio.CancelledError):
                await warmup

    def on_exception(request: Request, exc: Exception) -> Response:
        http_request = HttpRequest(request.method, request.scope["path"], request.headers, b"")
        if isinstance(exc, (NotFoundException, MethodNotAllowedException)):
            return _litestar_response(core.reject_unrouted(http_request))
        if isinstance(exc, RequestEntityTooLarge):
            error = ERRORS.request_too_large(size="", limit=settings.max_body_bytes)
        elif isinstance(exc, HTTPException) and exc.status_code < 500:
            error = ERRORS.invalid_request(detail=exc.detail)
        else:
            log.error("unhandled error on %s %s", request.method, request.scope["path"], exc_info=exc)
            error = ERRORS.internal_error()
        return _litestar_response(core.reject(http_request, error))

    app = Litestar(
        route_handlers=[_route_handler(core, path, endpoint) for path, endpoint in ENDPOINTS.items()],
        lifespan=[lifespan],
        exception_handlers={HTTPException: on_exception, Exception: on_exception},
        openapi_config=OpenAPIConfig(
            title="scorefn", version="0.1.0", path="/schema",
            description="Prefill-only LLM scoring: next-token log-probabilities of label tokens after "
                        "query + item (RFC-000), errors as in RFC-006.",
        ),
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # the process's logging is handler.logs' (or the host's), not Litestar's
        middleware=[in_flight.middleware],
    )
    app.state.core = core
    return app


class InFlight:
    """Counts the HTTP exchanges the app is still answering, so that shutdown can wait until they are sent."""

    def __init__(self) -> None:
        self.count = 0
        self._idle: asyncio.Event | None = None

    def bind(self) -> None:
        """Create the event on the running loop (the lifespan's)."""
        self._idle = asyncio.Event()
        self._idle.set()

    def middleware(self, app: Any) -> Any:
        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or self._idle is None:
                await app(scope, receive, send)
                return
            self.count += 1
            self._idle.clear()
            try:
                await app(scope, receive, send)
            finally:
                self.count -= 1
                if self.count == 0:
                    self._idle.set()
        return counted

    async def idle(self, timeout: float) -> None:
        if self._idle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)


def _route_handler(core: ScoringCore, path: str, endpoint: Endpoint) -> HTTPRouteHandler:
    async def forward(request: Request) -> Response:
        return await _forward(core, request)

    decorator = {"GET": get, "POST": post}[endpoint.method]
    return decorator(path, name=path, summary=endpoint.summary, status_code=200,
                     operation_class=_operation_class(endpoint))(forward)


async def _forward(core: ScoringCore, request: Request) -> Response:
    body: bytes | None = b""
    if request.method == "POST":
        try:
            body = await request.body()
        except RequestEntityTooLarge:  # Litestar stops reading at max_body_bytes; the core answers 413
            body = None
    http_request = HttpRequest(request.method, request.scope["path"], request.headers, body)
    if body is not None and len(body) > _INLINE_BODY_BYTES:
        outcome = await asyncio.to_thread(core.begin, http_request)
    else:
        outcome = core.begin(http_request)
    if isinstance(outcome, PendingScore):
        outcome = await _finish(core, outcome)
    return _litestar_response(outcome)


async def _finish(core: ScoringCore, pending: PendingScore) -> HttpResponse:
    result: Any
    try:
        result = await asyncio.wrap_future(pending.future)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not pending.future.cancelled() or (task is not None and task.cancelling()):
            raise  # this task is being cancelled (client gone, shutdown): cancellation propagates to the engine
        result = concurrent.futures.CancelledError()  # the engine cancelled the work (e.g. stopping)
    except Exception as exc:  # the engine's verdict; the core maps it to an error response
        result = exc
    if pending.job.n_tokens > _INLINE_TOKENS:
        return await asyncio.to_thread(core.finish, pending, result)
    return core.finish(pending, result)


def _litestar_response(response: HttpResponse) -> Response:
    headers = {name: value for name, value in response.headers if name != "content-type"}
    return Response(content=response.body, status_code=response.status, headers=headers,
                    media_type=response.media_type)


def _operation_class(endpoint: Endpoint) -> type[Operation]:
    """An OpenAPI Operation documenting the endpoint's structs (the route itself only sees raw bytes)."""
    request_body = None
    if endpoint.request is not None:
        request_body = RequestBody(required=True, content={
            JSON: OpenAPIMediaType(schema=schemas.openapi_schema(endpoint.request))})  # type: ignore[arg-type]
    responses = {"200": _response_doc("OK", endpoint.response)}
    if endpoint.scoring is not None:
        responses["200"].headers = _TIMING_HEADERS  # type: ignore[assignment]
    for status in endpoint.errors:
        responses[str(status)] = _response_doc(
            "Error: " + ", ".join(code for code, spec in ERRORS.items() if spec.status == status),
            schemas.ErrorEnvelope)

    @dataclasses.dataclass
    class EndpointOperation(Operation):
        def __post_init__(self) -> None:
            self.request_body = request_body
            self.responses = responses  # type: ignore[assignment]

    return EndpointOperation


_TIMING_HEADERS = {
    name: OpenAPIHeader(description=description, schema=Schema(type=OpenAPIType.STRING))
    for name, description in [
        ("x-request-id", "The client's x-request-id if it sent one (up to 128 printable ASCII characters), "
                         "else a new 32-hex-digit id."),
        ("x-queue-time", "Seconds the request waited for the device thread, as a decimal string (e.g. 0.001250)."),
        ("x-device-time", "Seconds of device time of the batches that computed it, as a decimal string."),
        ("x-total-time", "Seconds from receiving the body to building the response, as a decimal string."),
    ]
}


def _response_doc(description: str, struct: type | None) -> OpenAPIResponse:
    if struct is None:
        return OpenAPIResponse(description=description,
                               content={"text/plain": OpenAPIMediaType(schema={"type": "string"})})  # type: ignore[arg-type]
    return OpenAPIResponse(description=description,
                           content={JSON: OpenAPIMediaType(schema=schemas.openapi_schema(struct))})  # type: ignore[arg-type]


def __getattr__(name: str) -> Any:
    # `app` is built on first access (by the server), not at import: building it reads the environment and
    # sends the scorefn loggers to stdout as JSON, which importing the module (e.g. in tests) must not do.
    if name == "app":
        settings = load_settings()
        configure_logging(level=settings.log_level)
        globals()["app"] = built = create_app(settings, owns_process=True)
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
