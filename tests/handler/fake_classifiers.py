"""Classifiers for the fake engine (its tokenizer: one token per character, ord(c) % 1000, BOS = 1)."""

from __future__ import annotations

from runtime.tasks.classifiers import Classifier
from tests.handler.fake_engine import BOS, FakeEngine

PREFIX, SUFFIX = "Text: ", "\nSentiment:"


def _ids(text: str) -> tuple[int, ...]:
    return tuple(ord(c) % 1000 for c in text)


# The fake engine's logprob is -(label % 7) - 0.01 * length: labels 7 and 10 score 0 and -3 (+ a per-input constant).
SENTIMENT = Classifier(name="sentiment", labels=("positive", "negative"), label_ids=(7, 10), activation="softmax",
                       prompt=PREFIX + "{input}" + SUFFIX, prefix_ids=(BOS, *_ids(PREFIX)), suffix_ids=_ids(SUFFIX),
                       words=(" positive", " negative"))
TOPIC = Classifier(name="topic", labels=("sports", "politics", "science"), label_ids=(16, 14, 15),
                   activation="softmax", prompt="Topic of {input}:", prefix_ids=(BOS, *_ids("Topic of ")),
                   suffix_ids=_ids(":"), words=(" sports", " politics", " science"))
# A sequence-classification head: its "labels" are score rows 0 .. n-1 (fake logits 0, -1, -2).
HEAD = Classifier(name=FakeEngine.model_id, labels=("negative", "neutral", "positive"), label_ids=(0, 1, 2),
                  activation="softmax")
ONE_LABEL_HEAD = Classifier(name=FakeEngine.model_id, labels=("LABEL_0",), label_ids=(3,), activation="sigmoid")


def verbalizer_engine(**kwargs) -> FakeEngine:
    engine = FakeEngine(**kwargs)
    engine.classifiers = (SENTIMENT, TOPIC)
    return engine


def head_engine(head: Classifier = HEAD, **kwargs) -> FakeEngine:
    engine = FakeEngine(**kwargs)
    engine.task = "sequence_classification"
    engine.classifiers = (head,)
    return engine


def sentiment_prompt(text: str) -> list[int]:
    """The fake engine's tokens of SENTIMENT's prompt for `text`."""
    return [BOS, *_ids(PREFIX + text + SUFFIX)]
