"""Answering from a running scorefn (`--url`): at most `concurrency` requests in flight, each retried on 429 (after
its Retry-After), on 502/503/504 and on a dropped connection (with backoff); the API key from SCOREFN_API_KEY."""

from __future__ import annotations

import concurrent.futures
import logging

import httpx
import msgspec

from handler.batch.answering import RETRIED_STATUSES, Retry, RetryPolicy
from handler.batch.lines import Request
from handler.batch.records import Answer
from handler.http import JSON

log = logging.getLogger("scorefn.batch")
API_KEY_ENV = "SCOREFN_API_KEY"
READ_TIMEOUT_S = 600.0  # a server that queues the request answers within its own request timeout


class RemoteAnswerer:
    def __init__(self, url: str, concurrency: int, retry: RetryPolicy, api_key: str = "") -> None:
        headers = {"content-type": JSON, "user-agent": "scorefn-batch"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                  timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10.0))
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="scorefn-batch")
        self._retry = retry

    def start(self, request: Request) -> concurrent.futures.Future[Answer | None]:
        return self._pool.submit(self._answer, request)

    def _answer(self, request: Request) -> Answer | None:
        return self._retry.answer(request.line, lambda attempt: self._try(request))

    def _try(self, request: Request) -> Answer | Retry:
        try:
            response = self._http.post(request.url, content=request.body)
        except httpx.TransportError as exc:  # refused, reset, timed out: the server may be starting or gone
            return Retry(f"{type(exc).__name__}: {exc}")
        if response.status_code in RETRIED_STATUSES or not _is_json(response.content):
            return Retry(f"HTTP {response.status_code}", response.headers.get("retry-after"))
        return Answer(response.status_code, response.headers.get("x-request-id", ""), response.content)

    def close(self) -> None:
        self._retry.stop.set()  # a line waiting to retry gives up at once: it stays unanswered
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()


def _is_json(body: bytes) -> bool:
    """An answer is written into the output as it is: anything but JSON (a proxy's error page) is retried."""
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return True
