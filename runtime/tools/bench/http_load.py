"""W3, the benchmark's HTTP workload: concurrent clients against one at a time, on servers in their own processes
(CPU, embedded model), and the same concurrent load with tracing on against it off."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import httpx

from runtime.tools.bench.measure import summarize
from runtime.tools.otlp_receiver import OtlpReceiver
from runtime.tools.serverproc import ServerProcess

W3_BODY = {"query": "Review: the room was clean and close to the station. Sentiment:",
           "items": [" The friendly staff greeted us at the door."], "label_token_ids": [2731, 3524]}
W3_TRACED_ROUNDS = 3  # alternations of the concurrent load, tracing off then on
# The servers' buckets, sized for W3_BODY (a short query and item, 2 labels).
W3_ENV = {"SCOREFN_LENGTH_BUCKETS": "32,64", "SCOREFN_BATCH_BUCKETS": "1,2,4,8,16,32",
          "SCOREFN_SUFFIX_LENGTH_BUCKETS": "16", "SCOREFN_SUFFIX_BATCH_BUCKETS": "8", "SCOREFN_MAX_LABELS": "16"}


async def _http_clients(url: str, clients: int, seconds: float, body: dict) -> tuple[list[float], float]:
    """Latencies of the requests `clients` closed-loop clients send for `seconds`, and the wall time until the last
    answer (requests in flight at the deadline finish: counting them against `seconds` alone would overstate)."""
    latencies: list[float] = []
    started_at = time.perf_counter()
    stop_at = started_at + seconds

    async def client(http):
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            response = await http.post(url + "/v1/score", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies, time.perf_counter() - started_at


def _engine_counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + " ", name + "_total ")):  # counters carry the _total suffix
            return float(line.split()[1])
    return 0.0


def run_w3(seconds: float, clients: int, env: dict[str, str]) -> dict:
    """One client at a time, then `clients` at once; then the concurrent load with tracing on (every request's spans
    exported over OTLP/HTTP to a receiver in this process) against the same load with it off, in alternation
    (`traced_vs_off`; the spread of the runs with it off is the noise). Prints its lines."""
    # W3 measures how far batching across requests goes, not admission: the queue may wait as long as it takes.
    env = {**env, "SCOREFN_MAX_WAIT_S": "600"}
    with ServerProcess(env=env) as server, OtlpReceiver(decode=False) as receiver, ServerProcess(env={
            **env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_SAMPLER": "always_on"}) as traced:
        for each in (server, traced):
            asyncio.run(_http_clients(each.url, 1, 1.0, W3_BODY))  # connection set-up, first requests
        result = {name: _w3_load(server.url, n, seconds) for name, n in (("serial", 1), ("concurrent", clients))}
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(W3_TRACED_ROUNDS):
            for name, each in (("off", server), ("on", traced)):
                runs[name].append(_w3_load(each.url, clients, seconds / W3_TRACED_ROUNDS))
    rates = {name: [run["items_per_s"] for run in rows] for name, rows in runs.items()}
    result["traced"] = {"items_per_s_off": rates["off"], "items_per_s_on": rates["on"],
                        "traced_vs_off": float(np.median(rates["on"]) / np.median(rates["off"])),
                        "off_spread": max(rates["off"]) / min(rates["off"]) - 1, "exports": receiver.exports,
                        "exported_bytes": receiver.bytes}
    for name in ("serial", "concurrent"):
        row = result[name]
        print(f"W3 {name:10}: {row['items_per_s']:7.1f} items/s p50 {row['p50_ms']:7.1f} ms "
              f"p99 {row['p99_ms']:7.1f} ms mean device batch {row['mean_device_batch']:.1f}", flush=True)
    traced = result["traced"]
    print(f"W3 traced    : {traced['traced_vs_off']:.3f}x the items/s with tracing off (medians of "
          f"{W3_TRACED_ROUNDS} alternating runs; off runs spread {traced['off_spread']:.1%}; "
          f"{traced['exported_bytes'] / 1e6:.1f} MB of spans exported)", flush=True)
    return result


def _w3_load(url: str, clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients for `seconds`: items/s, latency percentiles, the mean device batch."""
    batches = _engine_counter(url, "scorefn_engine_device_batches")
    rows = _engine_counter(url, "scorefn_engine_device_batch_sequences")
    latencies, elapsed = asyncio.run(_http_clients(url, clients, seconds, W3_BODY))
    batches = _engine_counter(url, "scorefn_engine_device_batches") - batches
    rows = _engine_counter(url, "scorefn_engine_device_batch_sequences") - rows
    return {**summarize(latencies, 1), "items_per_s": len(latencies) / elapsed,
            "mean_device_batch": rows / batches if batches else 0.0}
