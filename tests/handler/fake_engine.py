"""A scoring engine with hand-computable outputs, for handler tests (no JAX).

Tokenizer: one token per character, ord(c) % 1000, with BOS = 1 in front when add_special_tokens;
detokenize: chr(id).
Scores: logprob(label | sequence) = -(label % 7) - 0.01 * len(sequence).
Per-position log-probabilities (see token_logprobs): after position t the most likely tokens are 97, 98, ...
('a', 'b', ...) with log-probabilities -0.1 * (k + 1) - 0.01 * t; the actual next token has -(token % 7) - 0.5;
the next token after a sequence is 97 (greedy) or 97 + seed % 20 (temperature > 0).
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from runtime.interface import MAX_TOP_LOGPROBS, ScoreResult, TokenLogprobs, TokenLogprobsResult

BOS = 1


def expected_logprob(sequence_length: int, label: int) -> float:
    return -(label % 7) - 0.01 * sequence_length


class FakeEngine:
    model_id = "fake-model"
    vocab_size = 1000
    max_sequence_length = 64
    task = "causal_lm"
    classifiers: tuple = ()  # tests/handler/test_classify.py installs some
    rerankers: tuple = ()  # tests/handler/test_rerank.py installs some
    batch_invariant = True
    adapters: tuple[str, ...] = ()  # LoRA adapters' names: tests/handler/test_lora_selection.py installs some
    platform_info = {"backend": "cpu", "dtype": "float32", "batch_invariant": "true"}

    def __init__(self, *, gated: bool = False) -> None:
        self.start_gate = threading.Event()  # start() waits for it when gated
        if not gated:
            self.start_gate.set()
        self.started = threading.Event()
        self.stopped = threading.Event()
        self.submitted = threading.Event()  # set by every submit(), for tests that resolve held futures
        self.submissions: list[tuple[list[list[int]], list[int], float | None]] = []
        self.request_ids: list[str | None] = []  # submit()'s request_id, one per submission
        self.adapters_used: list[str | None] = []  # the LoRA adapter of each submission
        self.salts_used: list[str | None] = []  # the cache_salt of each submission
        self.raise_on_submit: BaseException | None = None  # raised by submit() itself (e.g. QueueFull)
        self.fail_with: BaseException | None = None  # set as the future's exception
        self.hold = False  # leave futures pending in self.held
        self.held: list[concurrent.futures.Future] = []
        self.sampling: list = []  # submit_logprobs()'s last Sampling list
        self.start_calls = 0
        self.stop_grace: float | None = None

    @property
    def ready(self) -> bool:
        return self.started.is_set() and not self.stopped.is_set()

    def start(self) -> None:
        self.start_calls += 1
        self.start_gate.wait()
        self.started.set()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) % 1000 for c in text]
        return [BOS, *ids] if add_special_tokens else ids

    def submit(self, sequences: list[list[int]], label_ids: list[int], deadline: float | None = None,
               request_id: str | None = None, adapter: str | None = None, cache_salt: str | None = None
               ) -> concurrent.futures.Future[ScoreResult]:
        self.adapters_used.append(adapter)
        self.salts_used.append(cache_salt)
        return self._answer(sequences, label_ids, deadline, request_id, lambda: self.compute(sequences, label_ids))

    @staticmethod
    def compute(sequences: list[list[int]], label_ids: list) -> ScoreResult:
        """A label of several tokens: token k after the sequence and the label's k tokens before it."""
        if all(isinstance(label, int) for label in label_ids):
            logprobs = np.array([[expected_logprob(len(s), label) for label in label_ids] for s in sequences],
                                dtype=np.float32)
            return ScoreResult(logprobs=logprobs, queue_seconds=0.25, device_seconds=0.5)
        labels = [[label] if isinstance(label, int) else label for label in label_ids]
        tokens = [[np.array([expected_logprob(len(s) + k, t) for k, t in enumerate(label)], np.float32)
                   for label in labels] for s in sequences]
        sums = np.array([[float(np.sum(t, dtype=np.float64)) for t in row] for row in tokens], np.float32)
        return ScoreResult(sums, 0.25, 0.5, token_logprobs=tokens)

    def submit_logprobs(self, sequences: list[list[int]], sampling: list, deadline: float | None = None,
                        request_id: str | None = None, adapter: str | None = None, cache_salt: str | None = None
                        ) -> concurrent.futures.Future[TokenLogprobsResult]:
        self.sampling = list(sampling)
        self.adapters_used.append(adapter)
        self.salts_used.append(cache_salt)
        return self._answer(sequences, [], deadline, request_id, lambda: TokenLogprobsResult(
            [token_logprobs(s, how) for s, how in zip(sequences, sampling)], queue_seconds=0.25, device_seconds=0.5))

    def _answer(self, sequences: list[list[int]], label_ids: list[int], deadline: float | None,
                request_id: str | None, result) -> concurrent.futures.Future:
        """Record a submission, then raise, hold, fail or answer it as the test set the engine up."""
        self.submissions.append((sequences, label_ids, deadline))
        self.request_ids.append(request_id)
        self.submitted.set()
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.hold:
            self.held.append(future)
        elif self.fail_with is not None:
            future.set_exception(self.fail_with)
        else:
            future.set_result(result())
        return future

    def detokenize(self, token_ids: list[int]) -> list[str]:
        return [chr(i) for i in token_ids]

    def stats(self) -> dict[str, float | dict[str, float]]:
        return {"compiles": 12.0, "queue_depth": float(len(self.held)), "device_batches": float(len(self.submissions)),
                "device_batch_sequences": float(sum(len(s) for s, _, _ in self.submissions)),
                "predicted_wait_seconds": 0.75, "load": 0.4, "refused_wait": 3.0,
                "service_tokens_per_second": {"full": 900.0, "completion": 700.0}, "service_batch_overlap": 0.88}

    def stop(self, grace_seconds: float) -> None:
        self.stop_grace = grace_seconds
        self.stopped.set()


def token_logprobs(sequence: list[int], sampling) -> TokenLogprobs:
    T = len(sequence)
    top_ids = np.tile(np.arange(97, 97 + MAX_TOP_LOGPROBS, dtype=np.int32), (T, 1))
    top_logprobs = (-0.1 * (np.arange(MAX_TOP_LOGPROBS) + 1)[None, :] - 0.01 * np.arange(T)[:, None]).astype(np.float32)
    next_logprobs = np.array([-(token % 7) - 0.5 for token in sequence[1:]], dtype=np.float32)
    chosen = 97 + (sampling.seed % 20 if sampling.temperature > 0 else 0)
    return TokenLogprobs(next_logprobs, top_ids, top_logprobs, chosen, float(top_logprobs[-1, chosen - 97]))
