"""The engine's interface: what the handler may ask of a scoring engine (runtime.engine.Engine implements it).

Owned by the runtime and pure Python (no JAX), so the handler depends on the runtime's contract and nothing in
runtime/ imports handler/.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Protocol

import numpy as np

from runtime.tasks.classifiers import Classifier  # pure Python, like runtime.settings
from runtime.tasks.rerankers import Reranker


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What admission predicted for a request, to set beside what happened: its wait for the device behind other
    requests' work, and its own device seconds (its device batches run alone)."""
    queue_seconds: float
    device_seconds: float


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    logprobs: np.ndarray  # [n_sequences, n_labels] float32: log P(label | sequence) over the full vocabulary
    queue_seconds: float  # submitted -> picked up by the device thread
    device_seconds: float  # time of the device batch(es) that computed it
    predicted: Prediction | None = None
    # Labels given as token lists: each one's tokens' log-probabilities [n_sequences][n_labels] (float32 arrays),
    # whose sum (in float64) is its logprobs entry. None for labels of one token ID each.
    token_logprobs: list[list[np.ndarray]] | None = None
    cached_tokens: int = 0  # of the sequences' tokens, those whose keys and values the prefix cache held


MAX_TOP_LOGPROBS = 20  # the most alternatives per position one can ask for (OpenAI's limit); always computed


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the one token after a prompt is chosen: the most likely one (temperature 0), or drawn at `temperature`
    from a generator seeded with `seed` (the same seed, prompt and model draw the same token)."""
    temperature: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One sequence's prefill, read at every position: position t's distribution predicts token t + 1."""
    next_logprobs: np.ndarray  # [T - 1] float32: log P(tokens[t + 1] | tokens[: t + 1]), t = 0 .. T - 2
    top_ids: np.ndarray  # [T, MAX_TOP_LOGPROBS] int32: the most likely tokens after each position, best first
    top_logprobs: np.ndarray  # [T, MAX_TOP_LOGPROBS] float32, their log-probabilities
    next_id: int  # the token after the whole sequence, chosen as its Sampling says
    next_logprob: float  # its log-probability under the model (not the temperature)


@dataclasses.dataclass(frozen=True)
class TokenLogprobsResult:
    sequences: list[TokenLogprobs]  # in the order submitted
    queue_seconds: float
    device_seconds: float
    predicted: Prediction | None = None
    cached_tokens: int = 0  # of the prompts' tokens, those whose keys, values and outputs the prefix cache held


class EngineError(Exception):
    """Base of the errors an engine raises for a submitted request."""


class QueueFull(EngineError):
    """The engine takes no more work for now (-> 429 with Retry-After): the request cannot be answered in time, the
    instance is overloaded, or SCOREFN_MAX_QUEUE requests are waiting (runtime.requests.admission). `retry_after_s`:
    whole seconds until the work ahead is predicted to have drained enough (at least 1); `reason`: wait, deadline, late,
    overload or queue; `predicted`: what admission predicted for it."""

    def __init__(self, message: str = "the queue is full", retry_after_s: float = 1, reason: str = "queue",
                 predicted: Prediction | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.reason = reason
        self.predicted = predicted


class DeadlineExceeded(EngineError):
    """The request waited longer than its deadline and was dropped without being computed (-> 503)."""


class ShuttingDown(EngineError):
    """The server is stopping: it takes no new work, and work it had not done when the drain ended is dropped
    (-> 503 server_not_ready)."""


class EngineFault(EngineError):
    """The device batch holding this request failed or produced non-finite values (-> 500)."""


class ScoringEngine(Protocol):
    model_id: str
    vocab_size: int  # logit dimension: valid token IDs are 0 .. vocab_size - 1
    max_sequence_length: int  # largest length bucket
    task: str  # "causal_lm" (/v1/score and verbalizer classifiers) or "sequence_classification" (/v1/classify only)
    classifiers: tuple[Classifier, ...]  # what /v1/classify serves, the first one by default (known once ready)
    rerankers: tuple[Reranker, ...]  # what /v1/rerank serves, the first one by default (known once ready)
    batch_invariant: bool  # scores' bits never depend on what is batched with them (known once ready)
    adapters: tuple[str, ...]  # the LoRA adapters served beside the base model, by name (known once ready)
    # The platform's choices as labels (known once ready; empty before): backend, dtype, and on a CPU its model,
    # the feature class compiled for and why the dtype (/metrics scorefn_platform_info, /v1/models)
    platform_info: dict[str, str]

    @property
    def ready(self) -> bool:
        """True once every bucket is compiled and the device thread runs."""

    def start(self) -> None:
        """Load weights, compile every bucket, start the device thread (blocking; call off the event loop)."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def submit(self, sequences: list[list[int]], label_ids: list[int] | list[list[int]], deadline: float | None = None,
               request_id: str | None = None, adapter: str | None = None, cache_salt: str | None = None
               ) -> concurrent.futures.Future[ScoreResult]:
        """Queue sequences for scoring; raises QueueFull at once when the engine refuses more work (the request's
        predicted wait for the device is over SCOREFN_MAX_WAIT_S, or the queue is full). A label is a token ID, or
        a list of token IDs (a label of several tokens, at most SCOREFN_MAX_LABEL_TOKENS: its log-probability is the
        sum of its tokens', each after the sequence and the label's tokens before it; ScoreResult.token_logprobs has
        them).

        `deadline` is a time.monotonic() value after which the work is dropped (DeadlineExceeded).
        `request_id` names the request in the engine's logs (e.g. when its device batch fails).
        `adapter`: the LoRA adapter to score with, one of `adapters` (None: the base model).
        `cache_salt`: cached prefixes are shared only between requests with the same salt (None: the unsalted).
        Every sequence is non-empty and no longer than max_sequence_length; every ID is in range.
        """

    def submit_logprobs(self, sequences: list[list[int]], sampling: list[Sampling], deadline: float | None = None,
                        request_id: str | None = None, adapter: str | None = None, cache_salt: str | None = None
                        ) -> concurrent.futures.Future[TokenLogprobsResult]:
        """Queue sequences for per-position log-probabilities (one Sampling per sequence); as submit() otherwise.
        Only a causal LM (task "causal_lm") computes them."""

    def detokenize(self, token_ids: list[int]) -> list[str]:
        """Each token as the tokenizer decodes it alone (what OpenAI's `tokens` and `top_logprobs` show)."""

    def stats(self) -> dict[str, float | dict[str, float]]:
        """Counters and gauges for /metrics: compiles, queue_depth, device_batches, device_batch_sequences, and the
        admission's predicted_wait_seconds, backlog_seconds, service rates...; a dict value is one gauge per kind."""

    def stop(self, grace_seconds: float) -> None:
        """Stop taking work, finish what is queued within the grace period, stop the device thread."""
