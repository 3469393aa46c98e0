"""The scoring engine: loads a model, compiles every bucket, then scores on one dedicated device thread.

Requests wait in a bounded queue; the device thread coalesces whatever arrives within `batch_wait_ms`
(up to the largest batch bucket) into one round of device batches. Implements handler.engine.ScoringEngine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Sequence

import numpy as np

from handler.engine import DeadlineExceeded, EngineFault, QueueFull, ScoreResult
from runtime.buckets import BucketPlan, label_buckets
from runtime.classifiers import Classifier, build_classifiers
from runtime.loader import default_model_id
from runtime.rerankers import Reranker, build_rerankers
from runtime.settings import Settings, load_settings

log = logging.getLogger("scorefn.runtime")

_STOP = object()


@dataclasses.dataclass
class _Request:
    sequences: Sequence[Sequence[int]]
    label_ids: Sequence[int]
    deadline: float | None
    submitted: float
    future: concurrent.futures.Future
    request_id: str | None = None  # the HTTP request's id, for logs


def bucket_plan(settings: Settings) -> BucketPlan:
    return BucketPlan(
        lengths=settings.length_buckets, batches=settings.batch_buckets, max_tokens=settings.max_bucket_tokens,
        labels=label_buckets(settings.max_labels), context_lengths=settings.context_buckets,
        suffix_lengths=settings.suffix_length_buckets,
        suffix_batches=settings.suffix_batch_buckets, prefix_sharing=settings.prefix_sharing)


class Engine:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or load_settings()
        self.plan = bucket_plan(self.settings)
        self.max_sequence_length = self.plan.max_length
        self.model_id = self.settings.model_id or default_model_id(self.settings.model)
        self.vocab_size = 0  # known once the model is loaded
        self.task = "causal_lm"  # known once the model is loaded: causal_lm | sequence_classification
        self.classifiers: tuple[Classifier, ...] = ()  # what /v1/classify serves, checked at start-up
        self.rerankers: tuple[Reranker, ...] = ()  # what /v1/rerank serves, checked at start-up
        self.config = None
        self.scorer = None
        self.tokenizer = None
        self.timings: dict[str, float] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=self.settings.max_queue)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._counters = {"device_rounds": 0, "round_sequences": 0}

    # ---- life cycle -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping

    def start(self) -> None:
        from runtime import PROCESS_STARTED

        started = time.perf_counter()
        boot_seconds = time.monotonic() - PROCESS_STARTED  # interpreter, server and app imports
        from runtime import executables  # JAX, Flax, transformers: the heavy imports
        from runtime.loader import load_model, load_tokenizer

        executables.enable_persistent_cache(self.settings.xla_cache_dir)
        import_seconds = time.perf_counter() - started
        loaded = load_model(self.settings.model, self.settings.cache_dir, self.settings.model_id)
        self.config, self.model_id = loaded.cfg, loaded.model_id
        self.vocab_size = loaded.cfg.logit_dim if loaded.cfg.task == "causal_lm" else loaded.cfg.vocab_size
        self.tokenizer = load_tokenizer(loaded.model_dir)
        self.task = loaded.cfg.task
        # Verbalizers are checked against the tokenizer before compiling: a bad declaration fails the start fast.
        self.classifiers = build_classifiers(self.settings.classifiers, loaded.cfg, self.model_id, self.tokenizer,
                                             self.plan.max_labels)
        self.rerankers = build_rerankers(self.settings.rerankers, loaded.cfg, self.model_id, self.tokenizer,
                                         self.plan.max_labels, tuple(c.name for c in self.classifiers))
        self.scorer = self._build_scorer(loaded)
        load_seconds = time.perf_counter() - started - import_seconds

        compile_started = time.perf_counter()
        before = executables.cache_events()
        total = self.scorer.compile_all(self._log_progress)
        after = executables.cache_events()
        self.timings = {"boot_s": boot_seconds, "import_s": import_seconds, "load_s": load_seconds,
                        "compile_s": time.perf_counter() - compile_started, "buckets": total,
                        "cache_hits": after["hits"] - before["hits"],
                        "cache_misses": after["misses"] - before["misses"]}
        log.info("warm-up done: %d buckets in %.1f s (persistent cache: %d hits, %d misses)", total,
                 self.timings["compile_s"], self.timings["cache_hits"], self.timings["cache_misses"],
                 extra={"json_fields": {"timings": self.timings}})
        self.start_with(self.scorer)

    def start_with(self, scorer) -> None:
        """Serve with a scorer that is ready to run (start() passes its warmed-up one; fault tests a stub)."""
        self.scorer = scorer
        self._thread = threading.Thread(target=self._device_loop, name="scorefn-device", daemon=True)
        self._thread.start()
        self._ready.set()

    def _build_scorer(self, loaded):
        from runtime.executables import Executables
        from runtime.model import Llama
        from runtime.scorer import Scorer
        from runtime.sharding import build_layout

        # SCOREFN_MESH; a bad layout (MeshError) stops the start here, before any compilation.
        layout = build_layout(self.settings.mesh, loaded.cfg, self.plan)
        if layout is None:  # one device: the unsharded runtime, unchanged
            return Scorer(Llama(loaded.cfg, loaded.arrays, self.settings.dtype), self.plan)
        with layout.staging():
            model = Llama(loaded.cfg, loaded.arrays, self.settings.dtype)
        return Scorer(model, self.plan, executables=Executables(model, shardings=layout))

    def _log_progress(self, i: int, n: int, name: str, seconds: float) -> None:
        log.info("compiled bucket %d/%d %s in %.2f s", i, n, name, seconds)

    def stop(self, grace_seconds: float) -> None:
        """Refuse new work, let queued work finish within the grace period, stop the device thread."""
        self._stopping = True
        if self._thread is None:
            return
        deadline = time.monotonic() + grace_seconds
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)  # draining is bounded by the grace period
        self._cancel_queued()
        try:
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))

    def _cancel_queued(self) -> None:
        """After the grace period, work still queued is cancelled: its clients get 503, not a dropped connection."""
        cancelled = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and item.future.cancel():
                cancelled.append(item.request_id)
            self._queue.task_done()
        if cancelled:
            log.warning("drain grace period over: cancelled %d queued requests (request ids: %s)", len(cancelled),
                        ", ".join(map(str, cancelled)), extra={"json_fields": {"request_ids": cancelled}})

    # ---- the interface the handler uses -------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def submit(self, sequences, label_ids, deadline: float | None = None,
               request_id: str | None = None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            raise QueueFull("the server is shutting down")
        request = _Request(sequences, label_ids, deadline, time.monotonic(), future, request_id)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"{self.settings.max_queue} requests are already waiting") from None
        return future

    def score(self, sequences, label_ids) -> np.ndarray:
        """Blocking convenience: log P(label | sequence) [n_sequences, n_labels]."""
        return self.submit(sequences, label_ids).result().logprobs

    def stats(self) -> dict[str, float]:
        from runtime import executables

        scorer = self.scorer
        return {"compiles": scorer.exe.compiles if scorer else 0,
                "backend_compiles": executables.cache_events()["backend_compiles"],
                "queue_depth": self._queue.qsize(),
                "device_batches": scorer.device_batches if scorer else 0,
                "device_batch_sequences": scorer.device_rows if scorer else 0,
                **self._counters}

    # ---- the device thread ----------------------------------------------------------------------------

    def _collect(self, first: _Request) -> tuple[list[_Request], bool]:
        """`first` plus whatever arrives within batch_wait_ms, up to the largest batch bucket of rows."""
        batch, rows = [first], len(first.sequences)
        until = time.monotonic() + self.settings.batch_wait_ms / 1000.0
        capacity = self.plan.batches[-1]
        while rows < capacity:
            remaining = until - time.monotonic()
            try:
                item = self._queue.get_nowait() if remaining <= 0 else self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.task_done()
                return batch, True
            batch.append(item)
            rows += len(item.sequences)
        return batch, False

    def _device_loop(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                self._queue.task_done()
                break
            batch, stop = self._collect(first)
            try:
                self._run_round(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _run_round(self, batch: list[_Request]) -> None:
        from runtime.scorer import Job

        now = time.monotonic()
        live = []
        for request in batch:
            if not request.future.set_running_or_notify_cancel():
                continue  # the client went away
            if request.deadline is not None and now > request.deadline:
                request.future.set_exception(DeadlineExceeded(
                    f"waited {now - request.submitted:.2f} s in the queue, past the request deadline"))
                continue
            live.append(request)
        if not live:
            return
        started = time.perf_counter()
        try:
            results = self.scorer.score_jobs([Job(r.sequences, r.label_ids) for r in live])
        except Exception:
            ids = [r.request_id for r in live]
            log.exception("device round of %d requests failed (request ids: %s)", len(live), ", ".join(map(str, ids)),
                          extra={"json_fields": {"request_ids": ids}})
            for request in live:
                request.future.set_exception(EngineFault("the device batch failed"))
            return
        device_seconds = time.perf_counter() - started
        self._counters["device_rounds"] += 1
        self._counters["round_sequences"] += sum(len(r.sequences) for r in live)
        for request, logprobs in zip(live, results):
            if not np.all(np.isfinite(logprobs)):
                log.error("non-finite scores for request %s (%d sequences)", request.request_id,
                          len(request.sequences), extra={"json_fields": {"request_ids": [request.request_id]}})
                request.future.set_exception(EngineFault("the model produced non-finite scores"))
                continue
            request.future.set_result(ScoreResult(logprobs, now - request.submitted, device_seconds))


def build_engine(settings: Settings | None = None) -> Engine:
    return Engine(settings)
