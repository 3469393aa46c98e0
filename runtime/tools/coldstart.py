"""`scorefn coldstart`: process start to /ready with an empty vs a warm compile cache, and first-request latency.

Runs the production configuration (default buckets unless SCOREFN_* says otherwise) twice against one
fresh compilation cache directory: the first start compiles every bucket (those left for after ready, SCOREFN_READY,
before it stops), the second loads them from the executable store (runtime.assembly.store) without tracing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from runtime.tools.serverproc import ServerProcess, request_json

REQUEST = {"query": "The capital of France is", "items": [""], "label_token_ids": [7042, 4528]}


def _start(env: dict[str, str]) -> dict:
    started = time.perf_counter()
    server = ServerProcess(env=env, settle=False)  # the first request comes at /ready, as a user's would
    ready_s = time.perf_counter() - started
    try:
        def request() -> float:
            t = time.perf_counter()
            status, body = request_json(server.url + "/v1/score", REQUEST)
            if status != 200:
                raise RuntimeError(f"/v1/score answered {status}: {body}")
            return time.perf_counter() - t
        first = request()
        steady = [request() for _ in range(30)]
        server.wait_settled(900)  # what a start compiles after ready is stored: the next start is a warm one
    finally:
        server.stop()
    return {"ready_s": ready_s, **server.startup_timings, "first_request_ms": first * 1e3,
            "steady_p50_ms": float(np.median(steady) * 1e3)}


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="scorefn-xla-") as cache:
        env = {"SCOREFN_COMPILE_CACHE_DIR": cache}
        runs = {"empty cache": _start(env), "warm cache": _start(env)}
    print(f"{'start':12} {'to ready':>9} {'boot':>6} {'imports':>8} {'load':>6} {'compile':>8} {'buckets':>8} "
          f"{'stored':>7} {'hits':>5} {'1st req':>8} {'p50':>7}")
    for name, r in runs.items():
        print(f"{name:12} {r['ready_s']:8.1f}s {r.get('boot_s', 0):5.1f}s {r.get('import_s', 0):7.1f}s "
              f"{r.get('load_s', 0):5.1f}s {r.get('compile_s', 0):7.1f}s {r.get('buckets', 0):8} "
              f"{r.get('stored', 0):7} {r.get('cache_hits', 0):5} {r['first_request_ms']:6.1f}ms "
              f"{r['steady_p50_ms']:5.1f}ms")
    print(json.dumps(runs))
    return 0
