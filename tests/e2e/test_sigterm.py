"""SIGTERM on a real `scorefn serve` process: stop accepting, finish in-flight work within the grace period, exit 0."""

from __future__ import annotations

import concurrent.futures
import random
import signal
import threading
import time

import httpx
import pytest

from runtime.assembly.platform import current_backend, resolve
from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess
from runtime.settings import load_settings

pytestmark = [pytest.mark.slow, pytest.mark.timing]
POLL_S = 0.02  # interval between two looks at the server's queue
WAIT_S = 60.0
ROUNDS_IN_FLIGHT = resolve(load_settings(environ=SMALL_BUCKETS), current_backend()).rounds_in_flight
# These tests queue several seconds of work on purpose (draining, not admission, is what they check).
QUEUEING = {**SMALL_BUCKETS, "SCOREFN_MAX_WAIT_S": "600", "SCOREFN_REQUEST_TIMEOUT_S": "600"}


def heavy_body(rng: random.Random, items: int) -> dict:
    """Token-mode items of 32 tokens with no shared prefix: each request is its own device round(s)."""
    return {"query": [rng.randrange(100, 40000) for _ in range(4)],
            "items": [[rng.randrange(100, 40000) for _ in range(28)] for _ in range(items)],
            "label_token_ids": [7042, 4528]}


def engine_metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + " ", name + "_total ")):  # counters carry the _total suffix
            return float(line.split()[-1])
    return 0.0


def queue_depth(server: ServerProcess) -> float:
    return engine_metric(server, "scorefn_engine_queue_depth")


def send_while_queued(server: ServerProcess, pool: concurrent.futures.Executor, n: int,
                      items: int) -> list[concurrent.futures.Future]:
    """n concurrent requests; returns once the engine has admitted all of them and all but ROUNDS_IN_FLIGHT are
    unfinished (the head of the queue stays in it while slices of it run)."""
    rng = random.Random(n)
    bodies = [heavy_body(rng, items) for _ in range(n)]
    futures = [pool.submit(httpx.post, server.url + "/v1/score", json=body, timeout=WAIT_S) for body in bodies]
    deadline = time.monotonic() + WAIT_S
    while engine_metric(server, "scorefn_engine_admitted") < n or queue_depth(server) < n - ROUNDS_IN_FLIGHT:
        assert time.monotonic() < deadline and not any(f.done() for f in futures), "requests did not queue up"
        threading.Event().wait(POLL_S)
    return futures


def refused_or_503(call) -> None:
    try:
        response = call()
    except httpx.TransportError:  # the listener is closed: refused, or a kept-alive connection closed
        return
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "server_not_ready"


def test_sigterm_lets_in_flight_requests_finish_then_exits_0():
    grace = 30.0
    with ServerProcess(env={**QUEUEING, "SCOREFN_DRAIN_GRACE_S": str(grace)}) as server, \
            concurrent.futures.ThreadPoolExecutor(4) as pool, httpx.Client(base_url=server.url) as kept_alive:
        assert kept_alive.get("/health").status_code == 200  # a connection opened before the signal
        futures = send_while_queued(server, pool, 4, items=16)
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)

        refused_or_503(lambda: httpx.get(server.url + "/ready", timeout=10))
        refused_or_503(lambda: kept_alive.get("/ready", timeout=10))
        refused_or_503(lambda: httpx.post(server.url + "/v1/score", timeout=10,
                                          json={"query": "a", "items": [""], "label_token_ids": [1]}))

        for future in futures:
            response = future.result(timeout=WAIT_S)
            assert response.status_code == 200, response.text
            scores = response.json()["scores"]
            assert len(scores) == 16 and all(len(row) == 2 for row in scores)
        assert server.proc.wait(timeout=grace) == 0
        assert time.monotonic() - signalled < grace
    log = "".join(server.lines)
    assert "SIGTERM: draining" in log and '"message": "stopped"' in log
    assert "cancelled" not in log


def test_work_still_queued_after_the_grace_period_gets_503_and_the_process_exits_0():
    grace = 1.0
    # One-item requests of 60 tokens: a device round (at most 0.5 s of work) holds a few; seconds of work are left
    # when the 1 s grace period ends, however fast the machine.
    n = 60
    with ServerProcess(env={**QUEUEING, "SCOREFN_DRAIN_GRACE_S": str(grace)}) as server, \
            concurrent.futures.ThreadPoolExecutor(n) as pool:
        rng = random.Random(n)
        bodies = [{**heavy_body(rng, 0), "items": [[rng.randrange(100, 40000) for _ in range(56)]]} for _ in range(n)]
        futures = [pool.submit(httpx.post, server.url + "/v1/score", json=body, timeout=WAIT_S) for body in bodies]
        deadline = time.monotonic() + WAIT_S
        while engine_metric(server, "scorefn_engine_admitted") < n:  # every one reached the engine
            assert time.monotonic() < deadline, "requests did not queue up"
            threading.Event().wait(POLL_S)
        server.signal(signal.SIGTERM)
        responses = [future.result(timeout=WAIT_S) for future in futures]
        # granian kills the worker at grace + 5 s (--workers-kill-timeout); the drain ends well before.
        assert server.proc.wait(timeout=grace + 5) == 0

    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, [
        (r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    for response in responses:
        if response.status_code == 503:  # never a dropped connection: an answer in the envelope
            assert response.json()["error"]["code"] == "server_not_ready"
            assert response.headers["retry-after"]
    assert f"cancelled {statuses.count(503)} queued requests" in "".join(server.lines)
