"""Rerankers for the fake engine (its tokenizer: one token per character, ord(c) % 1000, BOS = 1)."""

from __future__ import annotations

import math

import numpy as np

from runtime.interface import ScoreResult
from runtime.tasks.rerankers import Reranker
from tests.handler.fake_engine import BOS, FakeEngine, expected_logprob

YES, NO = 7, 10  # the fake engine's log-probs: -0.01 * length, and -3 - 0.01 * length
MARK = ord("*")  # RerankEngine: each "*" in a pair adds 0.5 to the `yes` token's log-probability


def _cut(text: str, max_tokens: int) -> str:
    return text[:max_tokens]  # one token per character


RELEVANCE = Reranker(name="relevance", prompt="Q: {query}\nD: {document}\nA:", label_ids=(YES, NO),
                     words=(" yes", " no"), cut=_cut)
TERSE = Reranker(name="terse", prompt="{query}|{document}", label_ids=(NO, YES), words=("n", "y"), cut=_cut)
# A one-label sequence-classification head: its logit is the fake log-prob of label 0, -0.01 * length.
HEAD = Reranker(name=FakeEngine.model_id, prompt="{query}{document}", label_ids=(0,), cut=_cut)


def relevance_of(pair: str) -> float:
    """RerankEngine's relevance for RELEVANCE's rendered pair: sigmoid(lp_yes - lp_no)."""
    return 1 / (1 + math.exp(-(3 + 0.5 * pair.count("*"))))


class RerankEngine(FakeEngine):
    """The fake engine, with the `yes` token's log-probability raised by 0.5 per "*" in the sequence."""

    rerankers = (RELEVANCE, TERSE)

    @staticmethod
    def compute(sequences: list[list[int]], label_ids: list[int]) -> ScoreResult:
        logprobs = np.array([[expected_logprob(len(s), label) + (0.5 * s.count(MARK) if label == YES else 0.0)
                              for label in label_ids] for s in sequences], dtype=np.float32)
        return ScoreResult(logprobs=logprobs, queue_seconds=0.25, device_seconds=0.5)


def head_engine() -> FakeEngine:
    engine = FakeEngine()
    engine.task = "sequence_classification"
    engine.rerankers = (HEAD,)
    return engine


def pair_tokens(reranker: Reranker, query: str, document: str) -> list[int]:
    """The fake engine's tokens of a rendered pair (with BOS: the rerankers tokenize with special tokens)."""
    return [BOS, *(ord(c) % 1000 for c in reranker.render(query, document))]
