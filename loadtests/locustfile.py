"""Locust scenarios for scorefn's /v1/score, as clients use it (RFC-000's patterns) plus a share of bad requests.

Run through `python -m loadtests.run` (`make loadtest`), which starts the server and reads the summary this file
writes. By hand: `locust -f loadtests/locustfile.py --host http://127.0.0.1:8080`.

Every response is checked (catch_response): a 200 has one row per item and one score per label, finite and in
range; a 429 (admission under load) needs rate_limit_exceeded and a Retry-After; an invalid request must get its
4xx and error code in the RFC-006 envelope. The server's timing headers
(x-queue-time, x-device-time, x-total-time) are recorded as extra entries of type SERVER, in milliseconds.

Environment: LOADTEST_QUERY_WORDS (words in the ranking query; keep query + item within the server's longest
length bucket), LOADTEST_SUMMARY (where to write the JSON summary at exit).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from typing import Any

from locust import FastHttpUser, between, events, task

QUERY_WORDS = int(os.environ.get("LOADTEST_QUERY_WORDS", "200"))
SUMMARY_PATH = os.environ.get("LOADTEST_SUMMARY", "")
VOCAB = 49152  # the embedded model's; an ID at or above it must be refused
PARIS, LONDON, BERLIN, ROME = 7042, 4528, 11452, 7268  # SmolLM2's IDs of ' Paris' etc.
POSITIVE, NEGATIVE = 2731, 3524  # ' positive', ' negative'
YES, NO = 9805, 787  # ' yes', ' no'
TIMING_HEADERS = ("x-queue-time", "x-device-time", "x-total-time")
SERVER = "SERVER"  # request_type of the timing-header entries

WORDS = ("the city river market school music winter garden paper light north table story water morning "
         "bridge station museum forest island letter window summer doctor street village mountain").split()
REVIEWS = ["This movie was absolutely terrible and boring.", "A wonderful, moving film.", "Not bad at all.",
           "I want my two hours back.", "The acting was superb and the plot gripping.", "Meh."]
COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Egypt", "Peru", "Canada"]

# (body, expected status, expected error code); bytes are sent as they are
INVALID: list[tuple[Any, int, str]] = [
    ({"query": "x", "items": [], "label_token_ids": [PARIS]}, 400, "empty_items"),
    ({"query": "x", "items": [""], "label_token_ids": [VOCAB]}, 422, "token_id_exceeds_vocab"),
    ({"query": "x", "items": [""], "label_token_ids": [-1]}, 400, "negative_token_id"),
    ({"query": "x", "items": [""], "label_token_ids": [1], "apply_softmax": "yes"}, 400,
     "invalid_apply_softmax_type"),
    ({"query": [1, 2], "items": ["text"], "label_token_ids": [1]}, 400, "mixed_input_types"),
    ({"items": [""], "label_token_ids": [1]}, 400, "missing_query"),
    ({"query": "x", "items": [""], "label_token_ids": [1], "model": "no-such-model"}, 400, "model_not_found"),
    (b'{"query": "x", "items": [', 400, "invalid_json"),
]


def check_scores(body: dict, n_items: int, n_labels: int, softmax: bool) -> str | None:
    """What is wrong with a 200 body, or None."""
    scores = body.get("scores")
    if not isinstance(scores, list) or len(scores) != n_items:
        return f"expected {n_items} rows of scores, got {str(scores)[:100]}"
    for row in scores:
        if len(row) != n_labels or not all(isinstance(v, float) and math.isfinite(v) for v in row):
            return f"bad row {row}"
        if softmax and (min(row) < 0 or max(row) > 1 or abs(sum(row) - 1) > 1e-4):
            return f"softmax row out of range {row}"
        if not softmax and max(row) > 0:
            return f"positive log-probability {row}"
    if body.get("usage", {}).get("prompt_tokens", 0) <= 0:
        return "usage.prompt_tokens missing"
    return None


def refused_properly(response: Any) -> bool:
    """A 429 as documented: rate_limit_exceeded in the envelope, an integer Retry-After of at least 1 second."""
    try:
        retry_after = response.headers.get("retry-after", "")
        return response.json()["error"]["code"] == "rate_limit_exceeded" and retry_after.isdigit() and int(retry_after) >= 1
    except (ValueError, KeyError, TypeError):
        return False


class ScoringUser(FastHttpUser):
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random()

    def score(self, name: str, body: dict, softmax: bool = False) -> None:
        with self.client.post("/v1/score", json=body, name=name, catch_response=True) as response:
            if response.status_code == 429 and refused_properly(response):
                response.success()  # admission under load: counted in the status counts, not a failure
                return
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                problem = check_scores(response.json(), len(body["items"]), len(body["label_token_ids"]), softmax)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                problem = f"unreadable body ({exc!r}): {(response.text or '')[:200]}"
            if problem:
                response.failure(problem)
                return
            response.success()
            for header in TIMING_HEADERS:
                value = response.headers.get(header)
                if value is not None:
                    self.environment.events.request.fire(
                        request_type=SERVER, name=f"{name} {header}", response_time=float(value) * 1000,
                        response_length=0, exception=None, context={})

    @task(10)
    def classification(self) -> None:
        """One item, two labels, softmax over them."""
        body = {"query": f"Review: {self.rng.choice(REVIEWS)}\nSentiment:", "items": [""],
                "label_token_ids": [POSITIVE, NEGATIVE], "apply_softmax": True}
        self.score("classification", body, softmax=True)

    @task(6)
    def multiple_choice(self) -> None:
        """Four candidate contexts, which one leads to the label (RFC-000's context comparison)."""
        countries = self.rng.sample(COUNTRIES, 4)
        body = {"query": "The capital of", "items": [f" {c} is" for c in countries],
                "label_token_ids": [PARIS, LONDON, BERLIN, ROME]}
        self.score("multiple_choice", body)

    @task(2)
    def ranking(self) -> None:
        """A long query (a document) and 32 short candidates: one shared prefix, 32 suffixes."""
        document = " ".join(self.rng.choice(WORDS) for _ in range(QUERY_WORDS))
        items = [f" {self.rng.choice(WORDS)}?" for _ in range(32)]
        body = {"query": f"{document}. Is this text about", "items": items, "label_token_ids": [YES, NO]}
        self.score("ranking", body)

    @task(4)
    def token_mode(self) -> None:
        """Token IDs instead of text ("The capital of France is" and continuations)."""
        items = [[], *([self.rng.randrange(100, 40000)] for _ in range(self.rng.randrange(1, 4)))]
        body = {"query": [504, 3575, 282, 4649, 314], "items": items, "label_token_ids": [PARIS, LONDON]}
        self.score("token_mode", body)

    @task(1)
    def invalid(self) -> None:
        """A bad request: it must get exactly its documented status and error code."""
        body, status, code = self.rng.choice(INVALID)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        with self.client.post("/v1/score", data=data, headers={"content-type": "application/json"},
                              name=f"invalid {code}", catch_response=True) as response:
            try:
                error = response.json()["error"]
                ok = response.status_code == status and error["code"] == code and set(error) == {
                    "message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                response.success()
            else:
                response.failure(f"expected {status} {code}, got {response.status_code}: {(response.text or '')[:200]}")


# ---- the summary the runner reads -------------------------------------------------------------------------

class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times_ms: list[float] = []
        self.by_name: dict[str, list[float]] = {}
        self.server: dict[str, list[float]] = {}
        self.failures = 0
        self.statuses: dict[str, int] = {}
        self.first: float | None = None
        self.last: float | None = None

    def on_request(self, request_type: str, name: str, response_time: float, exception: Any = None,
                   response: Any = None, **_: Any) -> None:
        now = time.time()
        with self.lock:
            if request_type == SERVER:
                self.server.setdefault(name.rsplit(" ", 1)[-1], []).append(response_time)
                return
            self.first = self.first if self.first is not None else now - response_time / 1000
            self.last = now
            self.times_ms.append(response_time)
            self.by_name.setdefault(name, []).append(response_time)
            self.failures += exception is not None
            status = str(getattr(response, "status_code", 0) or 0)
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def summary(self) -> dict[str, Any]:
        with self.lock:
            n = len(self.times_ms)
            duration = (self.last - self.first) if n and self.last and self.first else 0.0
            return {
                "requests": n, "failures": self.failures, "failure_ratio": self.failures / n if n else 0.0,
                "duration_s": round(duration, 3), "rps": round(n / duration, 3) if duration else 0.0,
                **{f"p{q}_ms": percentile(self.times_ms, q) for q in (50, 95, 99)},
                "max_ms": max(self.times_ms, default=0.0),
                "status_counts": dict(sorted(self.statuses.items())),
                "server_5xx": sum(c for s, c in self.statuses.items() if s.startswith("5")),
                "scenarios": {name: {"requests": len(t), "p50_ms": percentile(t, 50), "p99_ms": percentile(t, 99)}
                              for name, t in sorted(self.by_name.items())},
                "server_timings_ms": {h: {"p50": percentile(t, 50), "p99": percentile(t, 99)}
                                      for h, t in sorted(self.server.items())},
            }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 3)


RECORDER = _Recorder()
events.request.add_listener(RECORDER.on_request)


@events.quitting.add_listener
def _write_summary(environment: Any, **_: Any) -> None:
    if SUMMARY_PATH:
        with open(SUMMARY_PATH, "w") as out:
            json.dump(RECORDER.summary(), out, indent=1)
