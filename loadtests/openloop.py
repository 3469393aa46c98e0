"""Open-loop overload of scorefn: Poisson arrivals at multiples of the rate measured in the same run.

Run through `python -m loadtests.run --open-loop MULTIPLE` (loadtests/overload.py), which starts the server, sets
OPENLOOP_PLAN (JSON) and judges the records this file writes to OPENLOOP_RECORDS. One locust user drives it all:

1. calibrate: `clients` closed-loop clients send the mix back to back; answered requests per second = the rate R.
2. baseline: Poisson arrivals at `baseline` x R (normal latency);
3. overload: `multiple` x R for `overload_s` seconds;
4. recovery: `baseline` x R again, for `recovery_s` seconds.

Open loop: an arrival is sent at its time whether or not earlier ones were answered, as independent clients do;
a closed loop would slow down with the server and hide its overload. The mix, by weight: one-item /v1/score 10,
32-item /v1/score 2, /v1/rerank 2, /v1/completions 2. Beside it, from the start, one bulk client sends
`bulk_items`-item /v1/score requests one after another (after a 429 it waits its Retry-After): the fairness case.
Every answer must be a checked 200 or a 429 `rate_limit_exceeded` with an integer Retry-After >= 1; anything else
is a failure in locust's statistics and in the records.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Any

import gevent
import gevent.pool
from locust import FastHttpUser, constant, task

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


def bulk_body(rng: random.Random, items: int) -> dict:
    return {"query": "Is this text about the", "items": [f" {rng.choice(WORDS)}" for _ in range(items)],
            "label_token_ids": [YES, NO]}


def rows_of(path: str, body: dict) -> int:
    if path == "/v1/score":
        return len(body.get("scores", []))
    if path == "/v1/rerank":
        return len(body.get("results", []))
    return len(body.get("choices", []))


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
                if status == 200:
                    answered = rows_of(path, response.json())
                    problem = None if answered == rows else f"{answered} rows for {rows}"
                    record.update(queue=float(response.headers.get("x-queue-time", "nan")),
                                  device=float(response.headers.get("x-device-time", "nan")))
                elif status == 429:
                    retry_after = response.headers.get("retry-after", "")
                    record["retry_after"] = int(retry_after) if retry_after.isdigit() else None
                    code = response.json()["error"]["code"]
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
        """One client sending large requests back to back, honouring Retry-After."""
        while not self.done:
            record = self.send("bulk", "/v1/score", bulk_body(self.rng, PLAN["bulk_items"]), PLAN["bulk_items"])
            if record["status"] == 429 and not self.done:
                gevent.sleep(record.get("retry_after") or 1)

    def arrivals(self, rate: float, seconds: float, group: gevent.pool.Group) -> None:
        """Poisson arrivals at `rate` per second for `seconds`, each request on its own greenlet."""
        start = time.monotonic()
        at = start
        while True:
            at += self.rng.expovariate(rate)
            if at >= start + seconds:
                break
            gevent.sleep(max(0.0, at - time.monotonic()))
            group.spawn(self.one)
        gevent.sleep(max(0.0, start + seconds - time.monotonic()))

    @task
    def run_plan(self) -> None:
        group = gevent.pool.Group()
        bulk = gevent.spawn(self.bulk_client) if PLAN.get("bulk_items") else None
        calibrate_s = PLAN["calibrate_s"]
        until = time.monotonic() + calibrate_s
        for _ in range(PLAN["clients"]):
            group.spawn(self.closed_loop_client, until)
        group.join()
        # Answered non-bulk requests per second over the calibration, the first second left out (a ramp).
        answered = [r for r in self.records if r["phase"] == "calibrate" and r["scenario"] != "bulk"
                    and r["status"] == 200 and r["sent"] + r["latency"] > 1.0]
        rate = max(len(answered) / max(calibrate_s - 1.0, 1e-3), 0.1)
        phases = [("baseline", PLAN["baseline"], PLAN["baseline_s"]),
                  ("overload", PLAN["multiple"], PLAN["overload_s"]),
                  ("recovery", PLAN["baseline"], PLAN["recovery_s"])]
        bounds = {"calibrate": [0.0, round(time.monotonic() - self.t0, 3)]}
        for phase, multiple, seconds in phases:
            if seconds <= 0:
                continue
            self.phase = phase
            started = time.monotonic() - self.t0
            self.arrivals(rate * multiple, seconds, group)
            bounds[phase] = [round(started, 3), round(time.monotonic() - self.t0, 3)]
        self.done = True
        group.join(timeout=PLAN.get("drain_s", 120))
        if bulk is not None:
            bulk.join(timeout=PLAN.get("drain_s", 120))
        if RECORDS_PATH:
            with open(RECORDS_PATH, "w") as out:
                json.dump({"rate": rate, "phases": bounds, "plan": PLAN, "records": self.records}, out)
        gevent.spawn(self.environment.runner.quit)
        gevent.sleep(math.inf)  # the runner stops this user
