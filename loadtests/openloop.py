"""Open-loop overload of scorefn: Poisson arrivals at multiples of the rate measured in the same run.

Run through `python -m loadtests.run --open-loop MULTIPLE` (loadtests/overload.py), which starts the server, sets
OPENLOOP_PLAN (JSON) and judges the records this file writes to OPENLOOP_RECORDS. One locust user drives it all:

1. calibrate: `clients` closed-loop clients send the mix back to back. The rate R is the server's capacity for the
   mix: requests of the mix per second of device time (the server's scorefn_engine_device_seconds_total over the
   phase, shared among the kinds by the service model's prices), the rate of a device kept busy; the clients' own
   rate (answered per second of the phase) and the rate the service model predicts alone are reported beside it.
   (`rate` in the plan skips it.)
2. baseline: Poisson arrivals at `baseline` x R (normal latency), for at least `baseline_s` and until `samples`
   one-item scores and completions are answered (the verdicts on latency judge that many);
3. overload: `multiple` x R for at least `overload_s`, and from when the server says it is overloaded (its load over
   1, polled: before that the arrivals are a burst), until `samples` of them are answered and every kind of the mix
   was sent often enough that its fairness verdict could fail (fair_sends);
4. recovery: `recovery` (default: `baseline`) x R: first until the server's backlog is back to the baseline's
   median (the overload's work done) and `recover_within_s` have passed (`settled`), then for at least `recovery_s`
   and until `samples` of the requests sent from then on are answered.
No phase runs longer than `max_phase_s`. The server's backlog is polled on /metrics through the baseline and the
recovery, its load through the overload. Between the calibration and the baseline the server is left to finish its work.

Open loop: an arrival is sent at its time whether or not earlier ones were answered, as independent clients do;
a closed loop would slow down with the server and hide its overload. The mix, by weight: one-item /v1/score 10,
32-item /v1/score 2, /v1/rerank 2, /v1/completions 2. Beside it, from the end of the calibration, one bulk client
sends `bulk_items`-item /v1/score requests one after another (after a 429 it waits its Retry-After and sends the same
request again): the fairness case. Every answer's x-predicted-queue-time and x-predicted-device-time (what admission
predicted, on a 429 too) are recorded beside the measured x-queue-time and x-device-time.
Every answer must be a checked 200 or a 429 `rate_limit_exceeded` with an integer Retry-After >= 1; anything else
is a failure in locust's statistics and in the records.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Any, Callable

import gevent
import gevent.pool
from locust import FastHttpUser, constant, task

from loadtests.overload import BOUNDED, LARGE, fair_sends

PLAN: dict[str, Any] = json.loads(os.environ.get("OPENLOOP_PLAN", "{}"))
RECORDS_PATH = os.environ.get("OPENLOOP_RECORDS", "")
POSITIVE, NEGATIVE, YES, NO = 2731, 3524, 9805, 787  # SmolLM2's ' positive', ' negative', ' yes', ' no'
WORDS = ("the city river market school music winter garden paper light north table story water morning "
         "bridge station museum forest island letter window summer doctor street village mountain").split()
REVIEWS = ["This movie was absolutely terrible and boring.", "A wonderful, moving film.", "Not bad at all.",
           "I want my two hours back.", "The acting was superb and the plot gripping.", "Meh."]
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "Dogs bark loudly.", "Rivers flow to the sea."]


def scenarios(rng: random.Random, query_words: int) -> list[tuple[str, str, dict, int]]:
    """(name, path, body, expected rows) of each kind of request, one of each, freshly drawn."""
    document = " ".join(rng.choice(WORDS) for _ in range(query_words))
    return [
        ("score 1 item", "/v1/score", {"query": f"Review: {rng.choice(REVIEWS)}\nSentiment:", "items": [""],
                                       "label_token_ids": [POSITIVE, NEGATIVE], "apply_softmax": True}, 1),
        ("score 32 items", "/v1/score", {"query": f"{document}. Is this text about",
                                         "items": [f" {rng.choice(WORDS)}?" for _ in range(32)],
                                         "label_token_ids": [YES, NO]}, 32),
        ("rerank", "/v1/rerank", {"model": "relevance", "query": "Capital of France?",
                                  "documents": rng.sample(DOCUMENTS, 3), "return_documents": False}, 3),
        ("completions", "/v1/completions", {"prompt": f"The {rng.choice(WORDS)} of the {rng.choice(WORDS)} is",
                                            "max_tokens": 0, "echo": True, "logprobs": 1}, 1),
    ]


WEIGHTS = (10, 2, 2, 2)
NAMES = ("score 1 item", "score 32 items", "rerank", "completions")  # scenarios()'s, in its order
POLL_S = 0.5


def bulk_body(rng: random.Random, items: int) -> dict:
    return {"query": "Is this text about the", "items": [f" {rng.choice(WORDS)}" for _ in range(items)],
            "label_token_ids": [YES, NO]}


def rows_of(path: str, body: dict) -> int:
    if path == "/v1/score":
        return len(body.get("scores", []))
    if path == "/v1/rerank":
        return len(body.get("results", []))
    return len(body.get("choices", []))



# The admission rule a 429's message names (runtime.requests.admission): what refused it, for the summary.
REFUSALS = (("could not start within", "late"), ("past its deadline", "deadline"), ("work are queued", "backlog"),
            ("is let in", "overload credit"), ("would wait", "wait"), ("already waiting", "queue"))


def refusal_reason(message: str) -> str:
    return next((reason for text, reason in REFUSALS if text in message), "other")

class OpenLoop(FastHttpUser):
    concurrency = 1024  # connections: arrivals never wait for one another
    network_timeout = 600.0
    connection_timeout = 600.0
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = random.Random(PLAN.get("seed", 0))
        self.records: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.phase = "calibrate"
        self.done = False

    def send(self, name: str, path: str, body: dict, rows: int) -> dict[str, Any]:
        sent = time.monotonic()
        record: dict[str, Any] = {"phase": self.phase, "scenario": name, "sent": round(sent - self.t0, 4)}
        with self.client.post(path, json=body, name=name, catch_response=True) as response:
            record["latency"] = round(time.monotonic() - sent, 4)
            record["status"] = status = response.status_code or 0
            problem = None
            try:
                record.update(predicted_queue=float(response.headers.get("x-predicted-queue-time", "nan")),
                              predicted_device=float(response.headers.get("x-predicted-device-time", "nan")))
                if status == 200:
                    answered = rows_of(path, response.json())
                    problem = None if answered == rows else f"{answered} rows for {rows}"
                    record.update(queue=float(response.headers.get("x-queue-time", "nan")),
                                  device=float(response.headers.get("x-device-time", "nan")))
                elif status == 429:
                    retry_after = response.headers.get("retry-after", "")
                    record["retry_after"] = int(retry_after) if retry_after.isdigit() else None
                    error = response.json()["error"]
                    code, record["refusal"] = error["code"], refusal_reason(error.get("message", ""))
                    if code != "rate_limit_exceeded" or not record["retry_after"]:
                        problem = f"429 {code} with Retry-After {retry_after!r}"
                else:
                    problem = f"status {status}: {(response.text or '')[:200]}"
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                problem = f"unreadable answer ({exc!r}): {(response.text or '')[:200]}"
            if problem:
                record["problem"] = problem
                response.failure(problem)
            else:
                response.success()
        self.records.append(record)
        return record

    def one(self) -> dict[str, Any]:
        name, path, body, rows = self.rng.choices(scenarios(self.rng, PLAN["query_words"]), WEIGHTS)[0]
        return self.send(name, path, body, rows)

    def closed_loop_client(self, until: float) -> None:
        """A client that waits for each answer (and a refusal's Retry-After) before its next request."""
        while time.monotonic() < until:
            record = self.one()
            if record["status"] == 429:
                gevent.sleep(min(record.get("retry_after") or 1, max(0.0, until - time.monotonic())))

    def bulk_client(self) -> None:
        """One client sending large requests back to back; a refused one is sent again after its Retry-After."""
        body = bulk_body(self.rng, self.bulk_items)
        while not self.done:
            record = self.send("bulk", "/v1/score", body, self.bulk_items)
            if record["status"] == 429 and not self.done:
                gevent.sleep(record.get("retry_after") or 1)
            else:
                body = bulk_body(self.rng, self.bulk_items)

    def size_bulk(self) -> list[tuple[int, float]]:
        """Size the bulk client's requests so that admission judges them large on this host: from PLAN's bulk_items,
        doubled until a request's own device time (x-predicted-device-time) is at least LARGE x the server's
        SCOREFN_MAX_WAIT_S, at most bulk_max_items. A request of at most half of it is a small one, promised an answer
        within SCOREFN_MAX_WAIT_S and counted in the small requests' load: a fixed item count is large on one host
        and small on a faster one, or on the same host from one run to the next (256 items: 0.9-1.03 s of own work
        against a 1 s bound on an Intel Xeon with AMX), and the recovery after the overload was then judged beside a
        client that kept the small requests' load over 1. Each size is sent once to the idle server, before the
        baseline; returns (items, own device seconds) of each."""
        max_wait = self.metric("scorefn_engine_max_wait_seconds")
        sizes: list[tuple[int, float]] = []
        for _ in range(16):  # an idle server admits any request within the limits: refusals are a few at most
            record = self.send("bulk", "/v1/score", bulk_body(self.rng, self.bulk_items), self.bulk_items)
            if record["status"] == 429:
                gevent.sleep(record.get("retry_after") or 1)
                continue
            sizes.append((self.bulk_items, record.get("predicted_device", math.nan)))
            if not sizes[-1][1] < LARGE * max_wait or self.bulk_items >= PLAN["bulk_max_items"]:
                break
            self.bulk_items = min(2 * self.bulk_items, PLAN["bulk_max_items"])
        return sizes

    def arrivals(self, rate: float, enough: Callable[[float], bool], group: gevent.pool.Group) -> None:
        """Poisson arrivals at `rate` per second, each request on its own greenlet, until `enough(seconds since the
        start)` (asked before each arrival) or PLAN's max_phase_s."""
        start = time.monotonic()
        at = start
        while not enough(at - start) and at - start < PLAN["max_phase_s"]:
            at += self.rng.expovariate(rate)
            gevent.sleep(max(0.0, at - time.monotonic()))
            group.spawn(self.one)

    def answered(self, since: float, kinds: tuple[str, ...] = BOUNDED) -> int:
        """Requests of these kinds sent since `since` (seconds from the start) and answered 200."""
        return sum(r["status"] == 200 and r["scenario"] in kinds and r["sent"] >= since for r in self.records)

    def sent_of_each_kind(self, since: float) -> int:
        """The fewest requests of one kind of the mix sent since `since`."""
        counts = {name: 0 for name in NAMES}
        for r in self.records:
            if r["sent"] >= since and r["scenario"] in counts:
                counts[r["scenario"]] += 1
        return min(counts.values())

    def poll(self, name: str, samples: list[tuple[float, float]], until: Callable[[], bool]) -> None:
        """One of the server's /metrics every POLL_S into `samples` (time from the start, value) until `until()`; a
        scrape that fails (the server busy past the connection's patience) is skipped."""
        while not until():
            try:
                samples.append((round(time.monotonic() - self.t0, 3), self.metric(name)))
            except RuntimeError:
                pass
            gevent.sleep(POLL_S)

    def metric(self, name: str) -> float:
        """One of the server's /metrics samples, e.g. scorefn_engine_device_seconds_total."""
        with self.client.get("/metrics", name="metrics", catch_response=True) as response:
            response.success()
            for line in (response.text or "").splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise RuntimeError(f"no {name} in the server's /metrics (status {response.status_code})")

    def drain(self, timeout: float) -> None:
        """Wait (polling /metrics) until the server has no work left, so the next phase starts from an idle server."""
        until = time.monotonic() + timeout
        while self.metric("scorefn_engine_backlog_seconds") > 0 and time.monotonic() < until:
            gevent.sleep(0.1)

    def calibrate(self, group: gevent.pool.Group) -> dict[str, float]:
        """Closed-loop clients for calibrate_s. The server's capacity for the mix: the device seconds per request of
        each kind (the service model's relative prices, x-predicted-device-time, scaled to the device seconds the
        phase really took), weighed by the mix: a sample of a few dozen requests holds the heavy kinds by chance,
        the weights do not. Beside it, the clients' rate (answered per second) and the service model's alone."""
        calibrate_s = PLAN["calibrate_s"]
        before, started = self.metric("scorefn_engine_device_seconds_total"), time.monotonic()
        until = started + calibrate_s
        for _ in range(PLAN["clients"]):
            group.spawn(self.closed_loop_client, until)
        group.join()
        device_s = self.metric("scorefn_engine_device_seconds_total") - before
        elapsed = time.monotonic() - started
        answered = [r for r in self.records if r["phase"] == "calibrate" and r["status"] == 200]
        predicted: dict[str, list[float]] = {}
        for r in answered:
            predicted.setdefault(r["scenario"], []).append(r["predicted_device"])
        names = [name for name, *_ in scenarios(random.Random(0), PLAN["query_words"])]
        if not all(predicted.get(name) for name in names):  # a kind never answered: the raw sample is all there is
            return {"server": len(answered) / max(device_s, 1e-3), "clients": len(answered) / elapsed, "model": 0.0,
                    "device_utilization": device_s / elapsed}
        price = {name: sum(values) / len(values) for name, values in predicted.items()}  # predicted s per request
        scale = device_s / sum(price[r["scenario"]] for r in answered)  # the device's seconds per predicted second
        per_request = sum(w * price[name] for name, w in zip(names, WEIGHTS)) / sum(WEIGHTS)
        return {"server": 1 / (scale * per_request), "clients": len(answered) / elapsed, "model": 1 / per_request,
                "device_utilization": device_s / elapsed, "sample": len(answered) / max(device_s, 1e-3)}

    @task
    def run_plan(self) -> None:
        group = gevent.pool.Group()
        rates = {"server": PLAN["rate"]} if PLAN.get("rate") else self.calibrate(group)
        rate = max(rates["server"], 0.1)
        bounds = {"calibrate": [0.0, round(time.monotonic() - self.t0, 3)]}
        self.drain(PLAN.get("drain_s", 120))
        self.bulk_items, self.phase = PLAN.get("bulk_items", 0), "sizing"
        bulk_sizes = self.size_bulk() if self.bulk_items else []
        self.records = [r for r in self.records if r["phase"] != "sizing"]  # an idle server's: no phase's
        bulk = gevent.spawn(self.bulk_client) if self.bulk_items else None
        need, backlog, settled = PLAN["samples"], [], [None]
        fair = fair_sends(PLAN["multiple"])

        def now() -> float:
            return time.monotonic() - self.t0

        def run(phase: str, multiple: float, enough: Callable[[float, float], bool]) -> None:
            self.phase = phase
            started = now()
            self.arrivals(rate * multiple, lambda elapsed: enough(started, elapsed), group)
            bounds[phase] = [round(started, 3), round(now(), 3)]

        def polled(name: str, samples: list, phase: str, multiple: float, enough: Callable) -> None:
            """Run a phase while polling one of the server's metrics."""
            polling = [True]
            poller = gevent.spawn(self.poll, name, samples, lambda: not polling[0])
            run(phase, multiple, enough)
            polling[0] = False
            poller.join()

        polled("scorefn_engine_backlog_seconds", backlog, "baseline", PLAN["baseline"],
               lambda started, elapsed: elapsed >= PLAN["baseline_s"] and self.answered(started) >= need)
        calm = sorted(b for _, b in backlog)[len(backlog) // 2] if backlog else 0.0

        def overloaded(started: float, elapsed: float) -> bool:
            """Judged from when the server says it is overloaded (before, a burst): its offered load over 1."""
            if since[0] is None:
                since[0] = next((t for t, load in loads if load > 1.0), None)
            return since[0] is not None and elapsed >= PLAN["overload_s"] and self.answered(since[0]) >= need \
                and self.sent_of_each_kind(since[0]) >= fair
        loads, since = [], [None]
        polled("scorefn_engine_load", loads, "overload", PLAN["multiple"], overloaded)
        if since[0] is not None:  # else the server never said it was overloaded
            bounds["overloaded"] = [since[0], bounds["overload"][1]]

        def recovered(started: float, elapsed: float) -> bool:
            if settled[0] is None:
                if not backlog or backlog[-1][1] > calm or elapsed < PLAN["recover_within_s"]:
                    return False
                settled[0] = max(backlog[-1][0], round(started + PLAN["recover_within_s"], 3))
            return now() - settled[0] >= PLAN["recovery_s"] and self.answered(settled[0]) >= need
        backlog.clear()
        polled("scorefn_engine_backlog_seconds", backlog, "recovery", PLAN.get("recovery", PLAN["baseline"]),
               recovered)
        if settled[0] is not None:  # else the backlog never drained to the baseline's
            bounds["settled"] = [settled[0], bounds["recovery"][1]]
        self.done = True
        group.join(timeout=PLAN.get("drain_s", 120))
        if bulk is not None:
            bulk.join(timeout=PLAN.get("drain_s", 120))
        if RECORDS_PATH:
            with open(RECORDS_PATH, "w") as out:
                json.dump({"rate": rate, "rates": rates, "phases": bounds, "calm_backlog_s": calm,
                           "bulk_sizes": bulk_sizes, "fair_sends": fair, "plan": PLAN, "records": self.records}, out)
        gevent.spawn(self.environment.runner.quit)
        gevent.sleep(math.inf)  # the runner stops this user

