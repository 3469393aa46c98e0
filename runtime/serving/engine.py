"""The scoring engine: loads a model, compiles every bucket, then scores on one dedicated device thread.

Requests wait in a bounded queue; the device thread coalesces whatever arrives within `batch_wait_ms`
(up to the largest batch bucket) into one round of device batches. Implements runtime.interface.ScoringEngine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from runtime.interface import DeadlineExceeded, EngineFault, QueueFull, ScoreResult, TokenLogprobsResult
from runtime.serving.buckets import BucketPlan
from runtime.serving.compose import bucket_plan  # noqa: F401 (tests build plans the engine's way)
from runtime.tasks.classifiers import Classifier, build_classifiers
from runtime.model.loader import default_model_id
from runtime.tasks.rerankers import Reranker, build_rerankers
from runtime.settings import Settings, load_settings

if TYPE_CHECKING:
    from runtime.serving.scorer import Job, TokenJob

log = logging.getLogger("scorefn.runtime")

_STOP = object()


@dataclasses.dataclass
class _Request:
    job: "Job | TokenJob"  # runtime.serving.scorer's
    deadline: float | None
    submitted: float
    future: concurrent.futures.Future
    request_id: str | None = None  # the HTTP request's id, for logs

    @property
    def sequences(self) -> Sequence[Sequence[int]]:
        return self.job.sequences


def build_scorer(settings: Settings, loaded, *, lazy: bool = False):
    """The scorer of a loaded model on this host's devices (runtime.serving.compose, the path `scorefn compile`
    shares). `lazy`: compile buckets on first use (one-shot CLI runs, never serving)."""
    from runtime.serving.compose import compose

    return compose(settings, loaded.cfg, loaded.arrays, lazy=lazy)


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
        self._queue: queue.Queue = queue.Queue(maxsize=self.settings.max_queue)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._counters = {"device_rounds": 0, "round_sequences": 0}
        self._in_flight = 0  # rounds dispatched and not yet answered
        self.rounds_in_flight = 1  # the platform's, once started
        self._in_flight_lock = threading.Lock()

    # ---- life cycle -------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping

    def start(self) -> None:
        from runtime import PROCESS_STARTED

        started = time.perf_counter()
        boot_seconds = time.monotonic() - PROCESS_STARTED  # interpreter, server and app imports
        from runtime.serving import executables  # JAX, Flax, transformers: the heavy imports
        from runtime.model.loader import load_model, load_tokenizer, resolve_model_dir

        executables.enable_persistent_cache(self.settings.xla_cache_dir)
        import_seconds = time.perf_counter() - started
        # The tokenizer (mostly importing transformers: Python, holding the GIL) loads beside the weights (mostly
        # NumPy dequantizing or copying them, which releases it).
        model_dir, _ = resolve_model_dir(self.settings.model, self.settings.cache_dir)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, model_dir)
            loaded = load_model(self.settings.model, self.settings.cache_dir, self.settings.model_id)
            self.tokenizer = tokenizer.result()
        self.config, self.model_id = loaded.cfg, loaded.model_id
        self.vocab_size = loaded.cfg.logit_dim if loaded.cfg.task == "causal_lm" else loaded.cfg.vocab_size
        self.task = loaded.cfg.task
        # Verbalizers are checked against the tokenizer before compiling: a bad declaration fails the start fast.
        self.classifiers = build_classifiers(self.settings.classifiers, loaded.cfg, self.model_id, self.tokenizer,
                                             self.settings.max_labels)
        self.rerankers = build_rerankers(self.settings.rerankers, loaded.cfg, self.model_id, self.tokenizer,
                                         self.settings.max_labels, tuple(c.name for c in self.classifiers))
        self.scorer, self.platform = build_scorer(self.settings, loaded)
        self.plan = self.scorer.plan
        self.rounds_in_flight = self.platform.rounds_in_flight
        load_seconds = time.perf_counter() - started - import_seconds

        compile_started = time.perf_counter()
        before = executables.cache_events()
        total = self.scorer.compile_all(self._log_progress)
        after = executables.cache_events()
        self.timings = {"boot_s": boot_seconds, "import_s": import_seconds, "load_s": load_seconds,
                        "compile_s": time.perf_counter() - compile_started, "buckets": total,
                        "stored": self.scorer.exe.loaded,
                        "cache_hits": after["hits"] - before["hits"],
                        "cache_misses": after["misses"] - before["misses"]}
        log.info("warm-up done: %d buckets in %.1f s (%d loaded from the executable store; persistent cache: "
                 "%d hits, %d misses)", total, self.timings["compile_s"], self.timings["stored"],
                 self.timings["cache_hits"], self.timings["cache_misses"],
                 extra={"json_fields": {"timings": self.timings}})
        self.start_with(self.scorer)

    def start_with(self, scorer) -> None:
        """Serve with a scorer that is ready to run (start() passes its warmed-up one; fault tests a stub)."""
        self.scorer = scorer
        self.plan = getattr(scorer, "plan", self.plan)
        self._thread = threading.Thread(target=self._device_loop, name="scorefn-device", daemon=True)
        self._thread.start()
        self._ready.set()

    def _log_progress(self, i: int, name: str, seconds: float) -> None:
        log.info("bucket %d/%d %s ready in %.2f s", i, self.plan.count(), name, seconds)

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
        from runtime.serving.scorer import Job

        return self._enqueue(Job(sequences, label_ids), deadline, request_id)

    def submit_logprobs(self, sequences, sampling, deadline: float | None = None,
                        request_id: str | None = None) -> concurrent.futures.Future:
        from runtime.serving.scorer import TokenJob

        if self.task != "causal_lm":
            raise ValueError(f"{self.model_id} is a {self.task} model: it has no per-token log-probabilities")
        return self._enqueue(TokenJob(sequences, sampling), deadline, request_id)

    def detokenize(self, token_ids) -> list[str]:
        return [self.tokenizer.decode([token_id]) for token_id in token_ids]

    def _enqueue(self, job, deadline: float | None, request_id: str | None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            raise QueueFull("the server is shutting down")
        try:
            self._queue.put_nowait(_Request(job, deadline, time.monotonic(), future, request_id))
        except queue.Full:
            raise QueueFull(f"{self.settings.max_queue} requests are already waiting") from None
        return future

    def score(self, sequences, label_ids) -> np.ndarray:
        """Blocking convenience: log P(label | sequence) [n_sequences, n_labels]."""
        return self.submit(sequences, label_ids).result().logprobs

    def stats(self) -> dict[str, float]:
        from runtime.serving import executables

        scorer = self.scorer
        return {"compiles": scorer.exe.compiles if scorer else 0,
                "backend_compiles": executables.cache_events()["backend_compiles"],
                "queue_depth": self._queue.qsize(),
                "device_batches": scorer.device_batches if scorer else 0,
                "device_batch_sequences": scorer.device_rows if scorer else 0,
                **self._counters}

    # ---- the device thread ----------------------------------------------------------------------------

    def _collect(self, first: _Request, wait: bool) -> tuple[list[_Request], bool]:
        """`first` plus whatever is queued (and, if `wait`, arrives within batch_wait_ms), up to the largest batch
        bucket of rows. Returns (requests, whether _STOP came)."""
        batch, rows = [first], len(first.sequences)
        until = time.monotonic() + (self.settings.batch_wait_ms / 1000.0 if wait else 0.0)
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
        """Plans and dispatches rounds; a fetcher thread waits for each one's results and answers its requests.

        At most `rounds_in_flight` (runtime.serving.platform) are dispatched and not yet fetched: with two, the next round
        is planned, padded and dispatched while the device still runs the one before, so the device never waits
        for the host; when every slot is taken, requests keep queueing and form a larger next round."""
        fetch: queue.Queue = queue.Queue()
        slots = threading.Semaphore(self.rounds_in_flight)
        fetcher = threading.Thread(target=self._fetch_loop, args=(fetch, slots), name="scorefn-fetch", daemon=True)
        fetcher.start()
        stop = False
        while not stop:
            slots.acquire()
            first = self._queue.get()
            if first is _STOP:
                self._queue.task_done()
                break
            # With a round on the device, what queued meanwhile is the coalescing window: no extra wait.
            batch, stop = self._collect(first, wait=self._in_flight == 0)
            with self._in_flight_lock:
                self._in_flight += 1
            fetch.put(self._launch(batch))
        fetch.put(_STOP)
        fetcher.join()

    def _fetch_loop(self, fetch: queue.Queue, slots: threading.Semaphore) -> None:
        while (launched := fetch.get()) is not _STOP:
            try:
                self._finish(launched)
            finally:
                with self._in_flight_lock:
                    self._in_flight -= 1
                slots.release()

    def _launch(self, batch: list[_Request]) -> "_Round":
        """Drop requests that were cancelled or waited past their deadline, dispatch the others' device work."""
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
        round = _Round(batch, live, now, time.perf_counter())
        if live:
            try:
                round.dispatched = self.scorer.dispatch([r.job for r in live])
            except Exception as exc:
                round.error = exc
        return round

    def _finish(self, round: "_Round") -> None:
        """Fetch a launched round's results and answer its requests (a failed round fails all of them)."""
        try:
            if not round.live:
                return
            try:
                if round.error is not None:
                    raise round.error
                results = self.scorer.collect(round.dispatched)
            except Exception:
                ids = [r.request_id for r in round.live]
                log.exception("device round of %d requests failed (request ids: %s)", len(round.live),
                              ", ".join(map(str, ids)), extra={"json_fields": {"request_ids": ids}})
                for request in round.live:
                    request.future.set_exception(EngineFault("the device batch failed"))
                return
            device_seconds = time.perf_counter() - round.started
            self._counters["device_rounds"] += 1
            self._counters["round_sequences"] += sum(len(r.sequences) for r in round.live)
            for request, result in zip(round.live, results):
                if not _finite(result):
                    log.error("non-finite scores for request %s (%d sequences)", request.request_id,
                              len(request.sequences), extra={"json_fields": {"request_ids": [request.request_id]}})
                    request.future.set_exception(EngineFault("the model produced non-finite scores"))
                    continue
                queued = round.picked - request.submitted
                request.future.set_result(ScoreResult(result, queued, device_seconds) if isinstance(result, np.ndarray)
                                          else TokenLogprobsResult(result, queued, device_seconds))
        finally:
            for _ in round.batch:
                self._queue.task_done()


def _finite(result) -> bool:
    """Scores [n, labels], or each TokenLogprobs' log-probabilities."""
    if isinstance(result, np.ndarray):
        return bool(np.all(np.isfinite(result)))
    return all(np.all(np.isfinite(t.next_logprobs)) and np.all(np.isfinite(t.top_logprobs))
               and np.isfinite(t.next_logprob) for t in result)


@dataclasses.dataclass
class _Round:
    batch: list[_Request]  # as taken from the queue (each marked done once the round is finished)
    live: list[_Request]  # those still wanted
    picked: float  # time.monotonic() when the device thread took them
    started: float  # time.perf_counter() at dispatch
    dispatched: object = None  # the scorer's Round
    error: Exception | None = None  # dispatching failed: finishing fails the requests


def build_engine(settings: Settings | None = None) -> Engine:
    return Engine(settings)
