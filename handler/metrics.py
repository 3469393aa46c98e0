"""Prometheus metrics in a per-app registry (two apps in one process, as in tests, never share counters)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from runtime.interface import ScoringEngine

log = logging.getLogger("scorefn.metrics")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# engine.stats() keys that only ever grow; every other key is exported as a gauge.
_ENGINE_COUNTERS = {
    "compiles": "XLA compilations; constant after warm-up (a request never triggers one).",
    "device_batches": "Device batches run.",
    "device_batch_sequences": "Sequences computed in device batches (divide by device_batches for the mean batch size).",
}
_ENGINE_COUNTERS.update({
    "device_rounds": "Device rounds run (each computes the slices of the requests it holds).",
    "round_sequences": "Sequences computed in device rounds.",
    "round_tokens": "Tokens of the sequences computed in device rounds.",
    "round_padded_tokens": "Padded tokens the device rounds computed, as planned (divide by round_tokens for the "
                           "padding overhead).",
    "device_seconds": "Seconds the device spent on rounds (their rate is the device's utilization).",
    "admitted": "Requests the engine admitted (queued for the device).",
    "refused_wait": "Small requests refused (429) because they would not be answered within SCOREFN_MAX_WAIT_S.",
    "refused_deadline": "Requests refused (429) because they would not start before their deadline "
                        "(SCOREFN_REQUEST_TIMEOUT_S).",
    "refused_overload": "Requests refused (429) because the instance was overloaded and its backlog over its limit.",
    "refused_queue": "Requests refused (429) because SCOREFN_MAX_QUEUE requests were waiting.",
    "refused_late": "Small requests admitted and then refused (429) because the device ran slower than predicted and "
                    "they could no longer start within SCOREFN_MAX_WAIT_S.",
    # the prefix cache's, exported as scorefn_prefix_cache_* (runtime.requests.prefix_cache)
    "prefix_cache_query_tokens": "Leading tokens of requests looked up in the prefix cache.",
    "prefix_cache_hit_tokens": "Of those, the tokens whose keys and values the cache held (not computed again).",
    "prefix_cache_evictions": "Cached prefixes evicted (least recently used) to stay within "
                              "SCOREFN_PREFIX_CACHE_BYTES.",
})
_ENGINE_GAUGES = {
    "queue_depth": "Requests waiting for the device, whole or in part.",
    "predicted_wait_seconds": "Predicted wait for the device of a new one-item request: the rounds in flight and "
                              "the shorter work queued.",
    "backlog_seconds": "Predicted device seconds of all admitted work not yet done.",
    "load": "Device seconds of work asked for per second over the last 30 s, refused work included (1: as much as "
            "the instance computes; above 1 it is overloaded): the autoscaling signal.",
    "max_wait_seconds": "SCOREFN_MAX_WAIT_S: a small request that would not be answered within it is refused.",
    "round_budget_seconds": "Predicted device seconds one round holds (a quarter of SCOREFN_MAX_WAIT_S, at most "
                            "SCOREFN_MAX_ROUND_S).",
    "service_seconds_per_batch": "Estimated fixed device seconds of one device batch (from the rounds run).",
    "service_tokens_per_second": "Estimated device throughput in padded tokens per second, by bucket kind "
                                 "(full, context, continuation, completion), once batches are large.",
    "service_batch_overlap": "Seconds of two device batches run at once (a CPU's launcher threads) over the sum of "
                             "each alone, measured at start; 1 where batches run one at a time.",
    "prefix_cache_bytes": "Bytes of keys and values the prefix cache holds (at most SCOREFN_PREFIX_CACHE_BYTES).",
    "prefix_cache_entries": "Prefixes the prefix cache holds.",
    "startup_seconds": "Seconds of each phase of the start (boot, import, load, compile, calibrate): their sum is "
                       "the time from the process's start to ready.",
    "startup_executables": "The start's executables by where they came from: stored (the executable store, e.g. "
                           "baked into the image), cache_hit (XLA's persistent cache) or compiled.",
}


class EngineStatsCollector(Collector):
    """Reads engine.stats() at scrape time; exports nothing while there is no engine yet."""

    def __init__(self, get_engine: Callable[[], ScoringEngine | None]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterator[Metric]:
        engine = self._get_engine()
        if engine is None:
            return
        try:
            stats = engine.stats()
        except Exception:  # a scrape must never fail because the engine is starting or stopping
            log.warning("engine.stats() failed", exc_info=True)
            return
        if engine.platform_info:  # exported as scorefn_platform_info{...} 1
            yield InfoMetricFamily("scorefn_platform", "The platform's choices: backend, dtype, batch invariance, and "
                                   "on a CPU its model, the feature class compiled for and why the dtype.",
                                   value=engine.platform_info)
        for key, value in sorted(stats.items()):
            name = ("scorefn_" if key.startswith("prefix_cache_") else "scorefn_engine_") + \
                re.sub(r"[^a-zA-Z0-9_]", "_", key)
            if key in _ENGINE_COUNTERS:
                yield CounterMetricFamily(name, _ENGINE_COUNTERS[key], value=float(value))
            elif isinstance(value, dict):  # one gauge per kind
                gauge = GaugeMetricFamily(name, _ENGINE_GAUGES.get(key, f"Engine statistic {key!r}."), labels=["kind"])
                for kind, number in sorted(value.items()):
                    gauge.add_metric([kind], float(number))
                yield gauge
            else:
                yield GaugeMetricFamily(name, _ENGINE_GAUGES.get(key, f"Engine statistic {key!r}."), value=float(value))


class Metrics:
    def __init__(self, get_engine: Callable[[], ScoringEngine | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("scorefn_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("scorefn_request_duration_seconds", "Server-side request latency by endpoint.",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("scorefn_queue_seconds", "Time a scoring request waited for the device thread.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.device_time = Histogram("scorefn_device_seconds", "Device time of the batches computing a request.",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.items_per_request = Histogram("scorefn_items_per_request", "Items (/v1/classify: inputs) in a successful request.",
                                           buckets=_ITEM_BUCKETS, registry=r)
        self.items = Counter("scorefn_items_scored", "Items (and /v1/classify inputs) scored.", registry=r)
        self.tokens = Counter("scorefn_tokens_scored", "Tokens in scored sequences.", registry=r)
        r.register(EngineStatsCollector(get_engine))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def observe_scored(self, items: int, tokens: int, queue_seconds: float, device_seconds: float) -> None:
        self.items_per_request.observe(items)
        self.items.inc(items)
        self.tokens.inc(tokens)
        self.queue_time.observe(queue_seconds)
        self.device_time.observe(device_seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
