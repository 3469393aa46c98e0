"""The scoring engine: loads a model, compiles every bucket, then scores on one dedicated device thread.

Requests are admitted by their predicted wait (runtime.requests.scheduler) and computed in rounds: the device thread
(runtime.requests.device_thread) takes a round's worth of queued work (large requests in slices, interleaved with
small ones), coalescing whatever arrives within `batch_wait_ms` on an idle device, and a fetcher thread answers each
round's requests. Implements runtime.interface.ScoringEngine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

import numpy as np

from runtime import PROCESS_STARTED, tracing
from runtime.interface import ShuttingDown
from runtime.shapes.buckets import BucketPlan
from runtime.requests.cost import ServiceModel
from runtime.requests.device_thread import NO_ROUNDS, DeviceThread, spans
from runtime.requests.jobs import Job, TokenJob, label_rows
from runtime.requests.scheduler import Scheduler
from runtime.requests.rounds import COUNTERS, RoundScorer
from runtime.tasks.classifiers import Classifier, adapter_heads, build_classifiers
from runtime.model.loader import default_model_id
from runtime.tasks.rerankers import Reranker, build_rerankers
from runtime.settings import Settings, load_settings

log = logging.getLogger("scorefn.runtime")


class Engine:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or load_settings()
        self.plan: BucketPlan | None = None  # and the platform: known once started (they need JAX's backend)
        self.platform = None
        self.max_sequence_length = self.settings.length_buckets[-1]
        self.model_id = self.settings.model_id or default_model_id(self.settings.model)
        self.vocab_size = 0  # known once the model is loaded
        self.task = "causal_lm"  # known once the model is loaded: causal_lm | sequence_classification
        self.classifiers: tuple[Classifier, ...] = ()  # what /v1/classify serves, checked at start-up
        self.rerankers: tuple[Reranker, ...] = ()  # what /v1/rerank serves, checked at start-up
        self.config = None
        self.scorer = None
        self.tokenizer = None
        self.timings: dict[str, float] = {}
        self.service: ServiceModel | None = None  # predicted device seconds of work, once started
        self._scheduler: Scheduler | None = None
        self._device: DeviceThread | None = None
        self._ready = threading.Event()
        self._settled = threading.Event()  # what the start left for after ready is done
        self._stopping = False
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None  # deferred executables, after ready
        self.rounds_in_flight = 1  # the platform's, once started
        self.batch_invariant = False  # the platform's, once started
        self.platform_info: dict[str, str] = {}  # the platform's, once started
        self.adapters: tuple[str, ...] = ()  # the LoRA adapters served (slots 1..n), once loaded

    # ---- life cycle -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping

    def start(self) -> None:
        """Load the model and its tokenizer, find its stored executables; build what it serves; compile every bucket
        the store does not hold; time the device; serve, and load the stored executables no round has loaded yet.
        Each step's seconds go to `timings` (and the "warm-up done" log line)."""
        laps = _Laps(PROCESS_STARTED)
        laps.lap("boot")  # the interpreter, the server and the app's imports
        # JAX, Flax and transformers: imported here, once the server already answers /health and /ready (503).
        from runtime.assembly import calibration, startup
        laps.lap("import")
        loaded = startup.load(self.settings)  # weights and tokenizer at once, and which stored set to take
        self._take_model(loaded.cfg, loaded.model.model_id, loaded.tokenizer)
        self._take_adapters(loaded.adapters)
        self.scorer, self.platform = startup.serving_scorer(self.settings, loaded)
        self.plan, self.rounds_in_flight = self.scorer.plan, self.platform.rounds_in_flight
        self.max_sequence_length = self.plan.max_length  # bucket lengths may round up (batch invariance)
        self.batch_invariant = self.platform.kernels.batch_invariant
        self.platform_info = self.platform.info()
        laps.lap("load")
        warmed = startup.warm_up(self.scorer, self._log_progress, self.settings.ready)
        laps.lap("compile")
        # A few buckets run once: the first requests are judged by real timings (compiling those still pending).
        service = calibration.calibrate(self.scorer)
        self.scorer.plan = self.plan = service.fit_plan(self.plan)
        laps.lap("calibrate")
        exe = self.scorer.exe
        self.timings = {**laps.seconds, **warmed, "deferred": exe.deferred, "pending": exe.pending}
        if tracing.tracer is not None:
            spans().started(laps.phases, self.model_id, self.platform_info, self.timings)
        log.info("warm-up done: %d buckets in %.1f s (%d loaded from the executable store, %d of them after ready; "
                 "%d compiled after ready; persistent cache: %d hits, %d misses); service time %s (timed in %.2f s)",
                 warmed["buckets"], self.timings["compile_s"], warmed["stored"], self.timings["deferred"],
                 self.timings["pending"], warmed["cache_hits"], warmed["cache_misses"], service.describe(),
                 self.timings["calibrate_s"], extra={"json_fields": {"timings": self.timings}})
        self.start_with(self.scorer, service)
        self._after_ready(exe)

    def _after_ready(self, exe) -> None:
        """After ready, on one thread, smallest first: the stored executables no round has loaded yet (a round that
        needs one loads it itself first, ~40 ms on a CPU, never compiling), then the buckets left to compile (a round
        that needs one waits for it, compiled next: Executables.compile_pending). A pool's thread, not a daemon: a
        process that ends without stop() finishes the loads queued, rather than dying in one."""
        keys = exe.deferred_keys()
        if not keys and not exe.pending:
            self._settled.set()
            return
        started = time.perf_counter()

        def load(name: str, bucket: tuple) -> None:
            try:
                exe.ensure(name, bucket)
            except Exception:  # a store that failed it, then its compile: the round that needs it will say so
                log.exception("executable store: %s%s not loaded after ready", name, bucket)
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scorefn-deferred")
        for key in keys:
            self._loader.submit(load, *key)
        if keys:
            self._loader.submit(lambda: log.info("executable store: the %d buckets deferred at start loaded %.2f s "
                                                 "after ready", len(keys), time.perf_counter() - started))
        if exe.pending:
            def compile_pending() -> None:
                done = exe.compile_pending(lambda i, name, seconds: log.info(
                    "bucket %s compiled after ready in %.2f s", name, seconds), lambda: self._stopping)
                log.info("compiled the %d buckets pending at ready %.2f s after ready", done,
                         time.perf_counter() - started)
            self._loader.submit(compile_pending)
        self._loader.submit(self._settled.set)

    def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until what a start leaves for after ready is done (stored executables loaded, pending buckets
        compiled); False if `timeout` passed first."""
        return self._settled.wait(timeout)

    def _take_model(self, cfg, model_id: str, tokenizer) -> None:
        """What the handler reads of the model, and the classifiers and rerankers it serves: checked against the
        tokenizer before anything compiles, so a bad declaration fails the start fast."""
        self.config, self.model_id, self.tokenizer, self.task = cfg, model_id, tokenizer, cfg.task
        self.vocab_size = cfg.logit_dim if cfg.task == "causal_lm" else cfg.vocab_size
        limits = self.settings.max_labels, self.settings.max_label_tokens
        self.classifiers = build_classifiers(self.settings.classifiers, cfg, model_id, tokenizer, *limits)
        self.rerankers = build_rerankers(self.settings.rerankers, cfg, model_id, tokenizer, *limits,
                                         tuple(c.name for c in self.classifiers))

    def _take_adapters(self, adapters) -> None:
        """The LoRA adapters served (slots 1..n); a classification adapter's own head is a classifier of its name."""
        self.adapters = tuple(adapter.name for adapter in adapters)
        self.classifiers += tuple(
            Classifier(name=a.name, labels=a.labels, label_ids=tuple(range(len(a.labels))),
                       activation="softmax" if len(a.labels) > 1 else "sigmoid", adapter=a.name)
            for a in adapters if a.head is not None)

    def start_with(self, scorer: RoundScorer, service: ServiceModel | None = None) -> None:
        """Serve with a scorer that is ready to run and the service model of its device (start() passes its
        warmed-up and timed ones; tests a stub scorer, with a neutral model)."""
        self.scorer = scorer
        self.plan = getattr(scorer, "plan", self.plan)
        self.service = service or ServiceModel.neutral()
        self._scheduler = Scheduler(self.service, lambda job: scorer.cost([job], marginal=True),
                                    self.settings.max_queue, self.settings.max_wait_s, self.settings.max_round_s,
                                    round_cost=scorer.cost,
                                    slice_rows=scorer.slice_rows,
                                    admitted=getattr(scorer, "expect", None))  # a stub scorer has none
        self._device = DeviceThread(self._scheduler, scorer, self.rounds_in_flight,
                                    self.settings.batch_wait_ms / 1000.0)
        self._device.start()
        self._ready.set()

    def _log_progress(self, i: int, name: str, seconds: float) -> None:
        log.info("bucket %d/%d %s ready in %.2f s", i, self.plan.count(), name, seconds)

    def stop(self, grace_seconds: float) -> None:
        """Refuse new work, let queued work finish within the grace period, stop the device thread."""
        self._stopping = True
        if self._loader is not None:  # the load under way finishes (~40 ms), the others are dropped; the compiler
            self._loader.shutdown(wait=False, cancel_futures=True)  # compiles only what a draining round waits for
        if self._device is None:
            if self._loader is not None:
                self._loader.shutdown(wait=True)
            return
        deadline = time.monotonic() + grace_seconds
        self._scheduler.close()
        self._scheduler.wait_idle(grace_seconds)
        self._cancel_queued()
        self._scheduler.stop()
        self._device.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._loader is not None:
            self._loader.shutdown(wait=True)

    def _cancel_queued(self) -> None:
        """After the grace period, work still queued is cancelled: its clients get 503, not a dropped connection."""
        cancelled = []
        for entry in self._scheduler.take_waiting():
            if not entry.future.cancel():  # started: slices of it were computed, the rest will not be
                self._device.fail(entry, ShuttingDown("the server stopped before this request's work was done"))
            cancelled.append(entry.request_id)
        if cancelled:
            log.warning("drain grace period over: cancelled %d queued requests (request ids: %s)", len(cancelled),
                        ", ".join(map(str, cancelled)), extra={"json_fields": {"request_ids": cancelled}})

    # ---- the interface the handler uses -------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def submit(self, sequences, label_ids, deadline: float | None = None, request_id: str | None = None,
               adapter: str | None = None, cache_salt: str | None = None) -> concurrent.futures.Future:
        if any(not isinstance(label, int) for label in label_ids):  # labels of several tokens: a row per label
            labels = [(label,) if isinstance(label, int) else tuple(label) for label in label_ids]
            job = dataclasses.replace(label_rows(sequences, labels, self._slot(adapter)), cache_salt=cache_salt)
            return self._enqueue(job, deadline, request_id)
        own_head = adapter in adapter_heads(self.classifiers)
        return self._enqueue(Job(sequences, label_ids, self._slot(adapter), head=own_head, cache_salt=cache_salt),
                             deadline, request_id)

    def submit_logprobs(self, sequences, sampling, deadline: float | None = None, request_id: str | None = None,
                        adapter: str | None = None, cache_salt: str | None = None) -> concurrent.futures.Future:
        if self.task != "causal_lm" or adapter in adapter_heads(self.classifiers):
            raise ValueError(f"{adapter or self.model_id} is a classifier: it has no per-token log-probabilities")
        return self._enqueue(TokenJob(sequences, sampling, self._slot(adapter), cache_salt), deadline, request_id)

    def _slot(self, adapter: str | None) -> int:
        """A LoRA adapter's slot in the programs (runtime.model.lora: 1..n), 0 for the base model."""
        if adapter is None:
            return 0
        if adapter not in self.adapters:
            raise ValueError(f"no LoRA adapter '{adapter}' is served (served: {list(self.adapters)})")
        return self.adapters.index(adapter) + 1

    def detokenize(self, token_ids) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def _enqueue(self, job, deadline: float | None, request_id: str | None) -> concurrent.futures.Future:
        if self._stopping or self._scheduler is None:
            raise ShuttingDown("the server is shutting down")
        trace = spans().request_trace() if tracing.tracer is not None else None  # under the caller's current span
        return self._scheduler.admit(job, deadline, request_id, trace)

    def score(self, sequences, label_ids) -> np.ndarray:
        """Blocking convenience: log P(label | sequence) [n_sequences, n_labels]."""
        return self.submit(sequences, label_ids).result().logprobs

    def stats(self) -> dict[str, float | dict[str, float]]:
        counters = self.scorer.counters() if self.scorer else dict.fromkeys(COUNTERS, 0)
        rounds = self._device.counters if self._device is not None else NO_ROUNDS
        stats: dict[str, float | dict[str, float]] = {**counters, "queue_depth": 0, **rounds}
        if self._scheduler is not None:
            stats.update(self._scheduler.stats(), service_seconds_per_batch=self.service.per_batch,
                         service_tokens_per_second=self.service.tokens_per_second(),
                         service_batch_overlap=self.service.overlap)
        if self.timings:  # the start, once it is done: its phases and where its executables came from
            stats["startup_seconds"] = {key.removesuffix("_s"): value for key, value in self.timings.items()
                                        if key.endswith("_s")}
            stats["startup_executables"] = {"stored": self.timings["stored"], "cache_hit": self.timings["cache_hits"],
                                            "compiled": self.timings["cache_misses"]}
        return stats


def build_engine(settings: Settings | None = None) -> Engine:
    return Engine(settings)


class _Laps:
    """A start's steps: lap(name) ends the step that began when the one before it ended (the first one at `began`, a
    time.monotonic() value). `seconds`: "<name>_s" -> its seconds; `phases`: (name, began, ended)."""

    def __init__(self, began: float) -> None:
        self.phases: list[tuple[str, float, float]] = []
        self.seconds: dict[str, float] = {}
        self._began = began

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.phases.append((name, self._began, now))
        self.seconds[f"{name}_s"], self._began = now - self._began, now
