"""Answering in process: the engine loaded in the job and every line through handler.core, as HTTP requests are.

Lines in flight are concurrent requests to the engine, which coalesces them into device rounds. The job is the
engine's only client and has no deadline, so admission may predict any wait: SCOREFN_MAX_WAIT_S and the request
timeout are lifted, rounds are longer (BATCH_ROUND_S), and a refusal that still comes (SCOREFN_MAX_QUEUE) is
retried.
"""

from __future__ import annotations

import logging
import time

from handler.batch.answering import RETRIED_STATUSES, Retry, RetryPolicy
from handler.batch.lines import Request
from handler.batch.records import Answer
from handler.core import ScoringCore
from handler.http import JSON, HttpRequest, HttpResponse, PendingScore
from handler.lifecycle import build_engine
from runtime.interface import ScoringEngine
from runtime.settings import Settings

log = logging.getLogger("scorefn.batch")
NO_DEADLINE_S = 7 * 24 * 3600.0  # a batch line waits as long as the lines before it take
# A round of a few seconds: a request of a few hundred items runs whole (its prefix once, its device batches full)
# rather than in slices of SCOREFN_MAX_ROUND_S, and the round in flight still ends within Cloud Run's 10 s SIGTERM.
BATCH_ROUND_S = 4.0


class LocalTicket:
    def __init__(self, core: ScoringCore, request: Request, retry: RetryPolicy) -> None:
        self._core, self._request, self._retry = core, request, retry
        self._outcome = self._begin()

    def _begin(self) -> HttpResponse | PendingScore:
        return self._core.begin(HttpRequest("POST", self._request.url, {"content-type": JSON}, self._request.body))

    def result(self) -> Answer | None:
        return self._retry.answer(self._request.line, self._try)

    def _try(self, attempt: int) -> Answer | Retry:
        """The first try was begun with the ticket (the line is in the engine's queue); later ones begin here."""
        outcome = self._outcome if attempt == 0 else self._begin()
        if isinstance(outcome, PendingScore):
            try:
                value = outcome.future.result()
            except Exception as exc:  # the engine's verdict; the core maps it to its answer
                value = exc
            outcome = self._core.finish(outcome, value)
        headers = dict(outcome.headers)
        if outcome.status in RETRIED_STATUSES:
            return Retry(f"still {outcome.status}", headers.get("retry-after"))
        return Answer(outcome.status, headers.get("x-request-id", ""), outcome.body)


class LocalAnswerer:
    def __init__(self, settings: Settings, retry: RetryPolicy, engine: ScoringEngine | None = None) -> None:
        """`engine`: the one to use, unstarted (default: runtime.engine's, built from the settings)."""
        self.settings = settings.replace(max_wait_s=NO_DEADLINE_S, request_timeout_s=NO_DEADLINE_S,
                                         max_round_s=max(settings.max_round_s or 0.0, BATCH_ROUND_S))
        self.core = ScoringCore(self.settings, engine or build_engine(self.settings))
        self._retry = retry

    def start_engine(self) -> float:
        """Load the model and its executables (blocking); the seconds it took."""
        started = time.perf_counter()
        self.core.engine.start()
        return time.perf_counter() - started

    def start(self, request: Request) -> LocalTicket:
        return LocalTicket(self.core, request, self._retry)

    def close(self) -> None:
        self.core.start_draining()
        self.core.engine.stop(self.settings.drain_grace_s)
