"""The framework-free core: an HttpRequest in, an HttpResponse out, shared by the ASGI and WSGI faces.

Scoring is asynchronous (engine.submit returns a concurrent.futures.Future), so a request takes two steps:

    outcome = core.begin(request)            # HttpResponse, or PendingScore for accepted scoring work
    if isinstance(outcome, PendingScore):    # ASGI: await asyncio.wrap_future(...); WSGI: .result()
        outcome = core.finish(outcome, result_or_exception)

Checks run in this order: route (404/405), API key on /v1/*, /v2/*, /rerank (401), body size (413),
readiness (503), JSON decoding (400), validation (400/422), admission by predicted wait (429).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time

import msgspec

from handler import schemas
from handler.classify import CLASSIFY, adapter_cards, model_cards
from handler.completions import COMPLETIONS
from handler.errors import ERRORS, ApiError, engine_error
from handler.http import (HttpRequest, HttpResponse, PendingScore, Scoring, ValidatedRequest, error_response,
                          json_response, predicted_headers, request_id_of, seconds)
from handler.logs import log_access
from handler.metrics import Metrics
from handler.rerank import RERANK, reranker_cards
from handler.score import SCORE
from handler.tracing import SpanHooks, request_span
from handler.validation import decode_body, validate_tokenize_request
from runtime.interface import QueueFull, ScoringEngine
from runtime.settings import Settings

log = logging.getLogger("scorefn.handler")


@dataclasses.dataclass(frozen=True)
class Endpoint:
    method: str
    summary: str
    request: type | None = None  # body struct (documented in OpenAPI)
    response: type | None = None  # 200 body struct
    errors: tuple[int, ...] = ()  # error statuses it can answer besides 404/405 (documented in OpenAPI)
    quiet: bool = False  # probes and scrapes: access-logged at DEBUG
    scoring: Scoring | None = None  # engine work: answered asynchronously, with timing headers


_SCORING_ERRORS = (400, 401, 413, 422, 429, 500, 503)
_RERANK = Endpoint("POST", "Rerank documents by relevance to a query (Cohere v2 / Jina / vLLM shape)",
                   schemas.RerankRequest, schemas.RerankResponse, (400, 401, 413, 429, 500, 503), scoring=RERANK)
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")  # vLLM serves all three; Cohere's clients call /v2/rerank

# The one routing table: each scoring endpoint's validation and response live in its own module.
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/score": Endpoint("POST", "Score label tokens after query + item, per item",
                          schemas.ScoreRequest, schemas.ScoreResponse, _SCORING_ERRORS, scoring=SCORE),
    "/v1/classify": Endpoint("POST", "Classify inputs (vLLM's classification API)",
                             schemas.ClassifyRequest, schemas.ClassifyResponse, _SCORING_ERRORS, scoring=CLASSIFY),
    **dict.fromkeys(RERANK_PATHS, _RERANK),
    "/v1/completions": Endpoint("POST", "Log-probabilities of every prompt token and at most one completion token "
                                "(OpenAI's legacy completions, prefill only)", schemas.CompletionRequest,
                                schemas.CompletionResponse, _SCORING_ERRORS, scoring=COMPLETIONS),
    "/v1/tokenize": Endpoint("POST", "Tokenize text (check that a label is a single token)",
                             schemas.TokenizeRequest, schemas.TokenizeResponse, (400, 401, 413, 500, 503)),
    "/v1/models": Endpoint("GET", "List the served model", None, schemas.ModelList, (401, 503)),
    "/health": Endpoint("GET", "Liveness: 200 while the process runs", None, schemas.Status, quiet=True),
    "/ready": Endpoint("GET", "Readiness: 200 once every shape is compiled, 503 while warming up or draining",
                       None, schemas.Status, (503,), quiet=True),
    "/metrics": Endpoint("GET", "Prometheus metrics (text exposition format)", quiet=True),
}
_AUTHENTICATED_PREFIXES = ("/v1/", "/v2/", "/rerank")  # every API path; probes and scrapes stay open
_SHOWN_PATH_CHARS = 200
_LOGGED_BODY_BYTES = 4096  # of a body, with SCOREFN_LOG_REQUESTS_DEBUG on


class ScoringCore:
    def __init__(self, settings: Settings, engine: ScoringEngine | None = None) -> None:
        self.settings = settings
        self.engine = engine  # None until a face's warm-up builds one
        self.metrics = Metrics(lambda: self.engine)
        self._draining = False
        self._api_keys = tuple(key.encode() for key in settings.api_keys)
        self._started_at = int(time.time())

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.ready and not self._draining

    def start_draining(self) -> None:
        """From now on /ready answers 503 and new work is refused; called before engine.stop()."""
        self._draining = True

    def begin(self, request: HttpRequest) -> HttpResponse | PendingScore:
        request_id = request_id_of(request)
        span = self._span(request, request_id)
        with span.current():
            if self.settings.log_requests_debug and request.body:
                body = request.body[:_LOGGED_BODY_BYTES].decode("utf-8", "replace")
                log.info("request %s body", request_id, extra={"json_fields": {"request_id": request_id,
                                                                               "body": body}})
            try:
                outcome = self._dispatch(request, request_id, span)
            except ApiError as error:
                outcome = error_response(error)
            except Exception:
                log.exception("request %s: unexpected error", request_id)
                outcome = error_response(ERRORS.internal_error())
            if isinstance(outcome, PendingScore):
                return outcome
            return self._complete(request, request_id, outcome, span)

    def finish(self, pending: PendingScore, outcome: object) -> HttpResponse:
        """The response for a PendingScore, given the future's result or the exception it raised."""
        with pending.span.current():
            try:
                if isinstance(outcome, BaseException):
                    raise self._engine_error(pending.request_id, outcome)
                with pending.span.child("encode"):
                    response = json_response(200, pending.scoring.respond(pending.job, outcome, self.engine))
                job = pending.job
                self.metrics.observe_scored(len(job.sequences), job.n_tokens, outcome.queue_seconds,
                                            outcome.device_seconds)
            except ApiError as error:
                response = error_response(error)
            except Exception as exc:  # building the response failed: a bug, or a result of the wrong shape
                response = error_response(self._engine_error(pending.request_id, exc))
            result = None if isinstance(outcome, BaseException) else outcome
            return self._complete(pending.request, pending.request_id, response, pending.span, pending.job, result)

    def _span(self, request: HttpRequest, request_id: str) -> SpanHooks:
        path = _normalized(request.path)
        return request_span(request.method, request.path, request.headers, path if path in ENDPOINTS else None,
                            request.started, None if request.body is None else len(request.body), request_id)

    # -- routing -------------------------------------------------------------------------------------------

    def reject(self, request: HttpRequest, error: ApiError) -> HttpResponse:
        """An error the face found before the core saw the request (e.g. malformed HTTP), logged and counted."""
        request_id = request_id_of(request)
        span = self._span(request, request_id)
        with span.current():
            return self._complete(request, request_id, error_response(error), span)

    def reject_unrouted(self, request: HttpRequest) -> HttpResponse:
        """The 404 or 405 for a request the framework could not route, worded as the core words it."""
        try:
            self._route(request)
            error = _not_found(request.path)  # the framework found no route where the core sees one
        except ApiError as routing_error:
            error = routing_error
        return self.reject(request, error)

    def _route(self, request: HttpRequest) -> Endpoint:
        path = _normalized(request.path)
        endpoint = ENDPOINTS.get(path)
        if endpoint is None:
            raise _not_found(path)
        if request.method not in (endpoint.method, "OPTIONS"):
            raise ERRORS.method_not_allowed(method=request.method[:16], path=path, allowed=endpoint.method,
                                            headers=(("allow", _allow(endpoint)),))
        return endpoint

    def _dispatch(self, request: HttpRequest, request_id: str, span: SpanHooks) -> HttpResponse | PendingScore:
        endpoint = self._route(request)
        path = _normalized(request.path)
        if request.method == "OPTIONS":  # what Litestar answers by itself, so both faces agree
            return HttpResponse(204, [("allow", _allow(endpoint))], b"")
        if path.startswith(_AUTHENTICATED_PREFIXES):
            self._authenticate(request)
        if endpoint.scoring is not None:
            return self._submit(request, request_id, endpoint.scoring, span)
        if path == "/v1/tokenize":
            return self._tokenize(request)
        if path == "/v1/models":
            return self._models()
        if path == "/ready":
            self._require_ready()
            return json_response(200, schemas.Status(status="ready"))
        if path == "/metrics":
            body, content_type = self.metrics.render()
            return HttpResponse(200, [("content-type", content_type)], body)
        return json_response(200, schemas.Status(status="ok"))  # /health

    def _authenticate(self, request: HttpRequest) -> None:
        if not self._api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Servers decode header bytes as latin-1; encoding back gives the bytes the client sent.
        given = token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else b""
        matched = False
        for key in self._api_keys:  # compare with every key: the time taken does not tell which one matched
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise ERRORS.invalid_api_key(headers=(("www-authenticate", "Bearer"),))

    def _body(self, request: HttpRequest) -> bytes:
        limit = self.settings.max_body_bytes
        if request.body is None or len(request.body) > limit:
            given = request.headers.get("content-length", "")
            size = f" ({given} bytes)" if given.isdigit() else ""
            raise ERRORS.request_too_large(size=size, limit=limit)
        return request.body

    def _require_ready(self) -> ScoringEngine:
        if self._draining:
            raise ERRORS.draining()
        if self.engine is None or not self.engine.ready:
            raise ERRORS.server_not_ready()
        return self.engine

    # -- endpoints -----------------------------------------------------------------------------------------

    def _submit(self, request: HttpRequest, request_id: str, scoring: Scoring, span: SpanHooks) -> PendingScore:
        body = self._body(request)
        engine = self._require_ready()
        with span.child("validate"):
            job = scoring.validate(decode_body(scoring.decoder, body), span.validating(engine), self.settings)
            span.tokenized()
        deadline = time.monotonic() + self.settings.request_timeout_s
        try:
            future = scoring.submit(engine, job, deadline, request_id)
        except Exception as exc:
            if isinstance(exc, QueueFull):
                span.refused(exc)
            raise self._engine_error(request_id, exc) from None
        return PendingScore(request, request_id, job, future, scoring, span)

    def _tokenize(self, request: HttpRequest) -> HttpResponse:
        body = self._body(request)
        engine = self._require_ready()
        text, add_special_tokens = validate_tokenize_request(decode_body(schemas.TOKENIZE_REQUEST_DECODER, body))
        tokens = list(engine.tokenize(text, add_special_tokens=add_special_tokens))
        return json_response(200, schemas.TokenizeResponse(tokens=tokens, count=len(tokens)))

    def _models(self) -> HttpResponse:
        if self.engine is None:
            raise ERRORS.model_loading()
        cards = reranker_cards(self.engine, model_cards(self.engine, self._started_at), self._started_at) + \
            adapter_cards(self.engine, self._started_at)
        # The served model's card says whether its scores are batch-invariant (its classifiers' and rerankers' too)
        # and the number format they are computed in.
        cards[0] = msgspec.structs.replace(cards[0], batch_invariant=self.engine.batch_invariant,
                                           dtype=self.engine.platform_info.get("dtype", msgspec.UNSET))
        return json_response(200, schemas.ModelList(data=cards))

    # -- outcome -------------------------------------------------------------------------------------------

    def _engine_error(self, request_id: str, exc: BaseException) -> ApiError:
        """What the client is told of an exception from the engine's work (handler.errors.ENGINE_ERRORS)."""
        if isinstance(exc, ApiError):
            return exc
        error = engine_error(exc)
        if error is None:
            log.error("request %s: scoring failed", request_id, exc_info=exc)
            return ERRORS.internal_error()
        wait = getattr(exc, "retry_after_s", None)  # a refusal (QueueFull) says when to retry, and what it predicted
        headers = () if wait is None else (("retry-after", str(wait)), *predicted_headers(exc.predicted))
        return error(reason=exc, wait=wait, plural="" if wait == 1 else "s",
                     timeout_s=self.settings.request_timeout_s, headers=headers)

    def _complete(self, request: HttpRequest, request_id: str, response: HttpResponse, span: SpanHooks,
                  job: ValidatedRequest | None = None, result: object = None) -> HttpResponse:
        """Headers, metrics, the access log line and the span's end (the span is the current one)."""
        total = time.perf_counter() - request.started
        path = _normalized(request.path)
        endpoint = ENDPOINTS.get(path)
        headers = [("x-request-id", request_id)]
        if endpoint is not None and endpoint.scoring is not None:  # timing headers, in seconds (handler.http)
            if result is not None:
                headers += [("x-queue-time", seconds(result.queue_seconds)),
                            ("x-device-time", seconds(result.device_seconds)), *predicted_headers(result.predicted)]
            headers.append(("x-total-time", seconds(total)))
        self.metrics.observe_request(path if endpoint else "unmatched", response.status, total)
        log_access(request_id=request_id, method=request.method[:16], path=path, status=response.status,
                   total_seconds=total, items=len(job.sequences) if job else None,
                   tokens=job.n_tokens if job else None,
                   queue_seconds=result.queue_seconds if result else None,
                   device_seconds=result.device_seconds if result else None,
                   quiet=endpoint is not None and endpoint.quiet)
        span.end(response.status, len(response.body), response.error_code, job, result)
        return HttpResponse(response.status, response.headers + headers, response.body)


def _allow(endpoint: Endpoint) -> str:
    return ", ".join(sorted((endpoint.method, "OPTIONS")))  # as Litestar writes it


def _not_found(path: str) -> ApiError:
    shown = _normalized(path)[:_SHOWN_PATH_CHARS]
    return ERRORS.not_found(path=shown, endpoints=", ".join(ENDPOINTS))


def _normalized(path: str) -> str:
    # Litestar matches "/v1/score/" as "/v1/score"; the WSGI face must agree.
    return path.rstrip("/") or "/"
