"""What the job asks of a way to answer lines (local: in process; remote: a server), and their retry policy."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable
from typing import Protocol

from handler.batch.lines import Request
from handler.batch.records import Answer

# Statuses that say "not now": the line is sent again, after Retry-After when the server gives one.
RETRIED_STATUSES = frozenset({429, 502, 503, 504})


class Ticket(Protocol):
    def result(self) -> Answer | None:
        """The line's answer, blocking; None when the job is stopping before it got one (it stays unanswered)."""


class Answerer(Protocol):
    def start(self, request: Request) -> Ticket: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Done:
    answer: Answer

    def result(self) -> Answer:
        return self.answer


@dataclasses.dataclass(frozen=True)
class Retry:
    """A try that asks to be tried again: what went wrong, and the server's Retry-After if it gave one."""
    failure: str
    retry_after: str | None = None


class GaveUp(Exception):
    """A line could not be answered after every retry: the job stops (a re-run goes on from there)."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 30  # tries per line before the job gives up
    base_s: float = 0.5  # backoff without Retry-After: base * 2^retry, jittered, at most cap_s
    cap_s: float = 30.0
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # set: stop waiting, give up quietly

    def wait(self, retry: int, retry_after: str | None) -> bool:
        """Wait before retry number `retry` (0-based); False when the job is stopping instead."""
        try:
            delay = min(float(retry_after), self.cap_s) if retry_after else None
        except ValueError:  # an HTTP date, or nonsense: back off as without one
            delay = None
        if delay is None:
            delay = min(self.base_s * 2 ** retry, self.cap_s) * random.uniform(0.5, 1.0)
        return not self.stop.wait(delay)

    def answer(self, line: int, attempt: Callable[[int], Answer | Retry]) -> Answer | None:
        """Try `attempt(k)` (k = 0, 1, ...) until it answers; None when the job stops first, GaveUp after the last
        try (naming the line and its last failure)."""
        for k in range(self.attempts):
            outcome = attempt(k)
            if isinstance(outcome, Answer):
                return outcome
            if not self.wait(k, outcome.retry_after):
                return None
        raise GaveUp(f"line {line}: {outcome.failure} after {self.attempts} tries")
