"""The device thread: takes the scheduler's rounds (runtime.requests.scheduler) and dispatches them to the scorer
(runtime.requests.rounds.RoundScorer); a fetcher thread collects each one's results and answers the requests it
completes. The engine (runtime.engine) starts it and stops it. Pure Python but for numpy."""

from __future__ import annotations

import logging
import queue
import threading
import time
from types import ModuleType

import numpy as np

from runtime import tracing
from runtime.interface import EngineFault, Prediction, ScoreResult, TokenLogprobsResult
from runtime.requests.jobs import label_scores
from runtime.requests.rounds import RoundScorer
from runtime.requests.scheduler import Scheduler
from runtime.requests.slices import Entry, Round

log = logging.getLogger("scorefn.runtime")

_STOP = object()
# What the device thread counts for /metrics, before its first round.
NO_ROUNDS = {"device_rounds": 0, "round_sequences": 0, "round_tokens": 0, "round_padded_tokens": 0.0,
             "device_seconds": 0.0}


class DeviceThread:
    """Takes and dispatches rounds; a fetcher thread waits for each one's results and answers its requests.

    At most `rounds_in_flight` (runtime.assembly.platform) are dispatched and not yet fetched: with two, the next
    round is planned, padded and dispatched while the device still runs the one before, so the device never waits
    for the host; when every slot is taken, requests keep queueing for the next round."""

    def __init__(self, scheduler: Scheduler, scorer: RoundScorer, rounds_in_flight: int, coalesce_s: float) -> None:
        """`coalesce_s`: how long an idle device waits for more requests to join a round (SCOREFN_BATCH_WAIT_MS)."""
        self.scheduler = scheduler
        self.scorer = scorer
        self.counters = dict(NO_ROUNDS)
        self._rounds_in_flight = rounds_in_flight
        self._coalesce_s = coalesce_s
        self._thread = threading.Thread(target=self._device_loop, name="scorefn-device", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end, once the scheduler is stopped."""
        self._thread.join(timeout=timeout)

    def _device_loop(self) -> None:
        fetch: queue.Queue = queue.Queue()
        slots = threading.Semaphore(self._rounds_in_flight)
        fetcher = threading.Thread(target=self._fetch_loop, args=(fetch, slots), name="scorefn-fetch", daemon=True)
        fetcher.start()
        while True:
            slots.acquire()
            # On an idle device, wait batch_wait_ms for more requests; with a round in flight, what queued
            # meanwhile is the coalescing window.
            round = self.scheduler.next_round(self._coalesce_s)
            if round is None:
                break
            if tracing.tracer is not None:
                spans().round_started(round)
            try:
                round.dispatched = self.scorer.dispatch([piece.job for piece in round.slices])
            except Exception as exc:
                round.error = exc
            fetch.put(round)
        fetch.put(_STOP)
        fetcher.join()

    def _fetch_loop(self, fetch: queue.Queue, slots: threading.Semaphore) -> None:
        while (round := fetch.get()) is not _STOP:
            try:
                self._finish(round)
            finally:
                slots.release()

    def _finish(self, round: Round) -> None:
        """Fetch a dispatched round's results and answer the requests it completes (a failed round fails all of
        them; a request with non-finite scores fails alone)."""
        results = None
        if round.error is None:
            try:
                results = self.scorer.collect(round.dispatched)
            except Exception as exc:
                round.error = exc
        seconds = self.scheduler.finish(round)
        if tracing.tracer is not None:
            spans().round_finished(round, getattr(round.dispatched, "buckets", []))  # a stub scorer's has none
        log.debug("round of %d slices: predicted %.3f s, took %.3f s", len(round.slices), round.predicted_s, seconds,
                  extra={"json_fields": {"slices": [[piece.entry.request_id, piece.start, piece.stop]
                                                    for piece in round.slices],
                                         "predicted_s": round.predicted_s, "seconds": seconds,
                                         **self.scheduler.stats()}})
        if round.error is not None:
            ids = [piece.entry.request_id for piece in round.slices]
            log.error("device round of %d requests failed (request ids: %s)", len(ids), ", ".join(map(str, ids)),
                      exc_info=round.error, extra={"json_fields": {"request_ids": ids}})
            for piece in round.slices:
                self.fail(piece.entry, EngineFault("the device batch failed"))
            return
        self.counters["device_rounds"] += 1
        self.counters["round_sequences"] += sum(piece.stop - piece.start for piece in round.slices)
        self.counters["round_tokens"] += sum(len(sequence) for piece in round.slices
                                             for sequence in piece.entry.job.sequences[piece.start:piece.stop])
        self.counters["round_padded_tokens"] += round.work.tokens
        self.counters["device_seconds"] += seconds
        cached = getattr(round.dispatched, "cached_tokens", None) or [0] * len(round.slices)  # a stub's has none
        for piece, result, held in zip(round.slices, results, cached):
            entry = piece.entry
            entry.cached_tokens += held
            if entry.future.done():  # failed in another round, or cancelled by the drain
                continue
            if not _finite(result):
                log.error("non-finite scores for request %s (%d sequences)", entry.request_id, entry.rows,
                          extra={"json_fields": {"request_ids": [entry.request_id]}})
                self.fail(entry, EngineFault("the model produced non-finite scores"))
                continue
            if entry.add(piece.start, result, seconds):
                entry.future.set_result(_result(entry))

    def fail(self, entry: Entry, error: Exception) -> None:
        """A request fails: none of its other rows are computed, and its client gets `error`."""
        self.scheduler.drop(entry)
        if not entry.future.done():
            entry.future.set_exception(error)


def _result(entry: Entry) -> ScoreResult | TokenLogprobsResult:
    """A request's slices put together; its queue time is all its time not spent in its rounds."""
    parts = entry.results()
    queued = max(0.0, time.monotonic() - entry.submitted - entry.device_s)
    predicted = Prediction(entry.admission.wait_s, entry.admission.own_s) if entry.admission else None
    if isinstance(parts[0], np.ndarray):
        values = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if entry.job.targets is not None:  # label_rows: each label's tokens, summed; a sequence's rows hold it once
            sums, tokens = label_scores(values, entry.job.label_ids)
            cached = entry.cached_tokens // max(len(entry.job.label_ids), 1)
            return ScoreResult(sums, queued, entry.device_s, predicted, tokens, cached)
        return ScoreResult(values, queued, entry.device_s, predicted, cached_tokens=entry.cached_tokens)
    return TokenLogprobsResult([sequence for part in parts for sequence in part], queued, entry.device_s, predicted,
                               entry.cached_tokens)


def _finite(result) -> bool:
    """Scores [n, labels], or each TokenLogprobs' log-probabilities."""
    if isinstance(result, np.ndarray):
        return bool(np.all(np.isfinite(result)))
    return all(np.all(np.isfinite(t.next_logprobs)) and np.all(np.isfinite(t.top_logprobs))
               and np.isfinite(t.next_logprob) for t in result)


def spans() -> ModuleType:
    """runtime.requests.spans, which imports OpenTelemetry: loaded once tracing is on (the engine's spans too)."""
    from runtime.requests import spans

    return spans
