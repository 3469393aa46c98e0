"""What /v1/classify serves: a sequence-classification head, or prompt-verbalizer classifiers on a causal LM.

A prompt-verbalizer classifier renders a template around the input and reads the log-probabilities of one
verbalizer word per label (e.g. " positive" / " very negative"); its probs are the softmax over those
words' log-probabilities (a word of several tokens: the sum of its tokens', each after the ones before it).
They are declared in a TOML file (SCOREFN_CLASSIFIERS; empty: BUILTIN_TOML below):

    [[classifier]]
    name = "topic"                   # what `model` selects in a request
    template = "Text: {input}\\nTopic (sports, politics or science):"   # exactly one {input}
    labels = { sports = " sports", politics = " politics", science = " science" }   # label -> word, in order
    # chat = true                    # wrap the template in the model's chat template, as the user's message
    # assistant_prefix = "Topic:"    # with chat: text that follows the assistant header

A verbalizer is 1 to SCOREFN_MAX_LABEL_TOKENS tokens (`tokenizer.encode(word, add_special_tokens=False)`); start-up
fails otherwise, naming the classifier, label, word and its tokens. Pure Python: the handler imports `Classifier`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from runtime.tasks import declarations

log = logging.getLogger("scorefn.runtime")

INPUT = "{input}"

# The embedded default: sentiment on SmolLM2-135M-Instruct. The chat form (with SmolLM2's default system
# prompt, which its chat template adds) classified 20 of 20 clearly positive / negative sentences correctly;
# a plain "Review: ... Sentiment:" prompt got 15 of 20.
BUILTIN_TOML = '''
[[classifier]]
name = "sentiment"
template = "Classify the sentiment of this text as positive or negative.\\nText: {input}"
chat = true
assistant_prefix = "Sentiment:"
labels = { positive = " positive", negative = " negative" }
'''

_KEYS = {"name", "template", "labels", *declarations.CHAT_KEYS}


class ClassifierError(ValueError):
    """A classifier declaration that cannot be served (start-up fails with this message)."""


@dataclasses.dataclass(frozen=True)
class ClassifierSpec:
    """A prompt-verbalizer classifier as declared, before the served model's tokenizer is known."""
    name: str
    template: str
    labels: tuple[str, ...]
    words: tuple[str, ...]  # one verbalizer word per label
    chat: bool = False
    assistant_prefix: str = ""


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A classifier ready to serve: what engine.submit needs and how to read its scores."""
    name: str
    labels: tuple[str, ...]
    # submit()'s label_ids: each verbalizer's token ID (or its tokens' tuple), or 0 .. n-1 for a classification head
    label_ids: tuple[int | tuple[int, ...], ...]
    activation: str  # use_activation=true: "softmax" or "sigmoid" (one-label and multi-label heads)
    prompt: str | None = None  # the rendered template, with one {input}; None: the input is scored as is
    add_special_tokens: bool = True  # when tokenizing a text input (a chat-rendered prompt has its own)
    prefix_ids: tuple[int, ...] = ()  # a token-ID input is scored as prefix_ids + input + suffix_ids
    suffix_ids: tuple[int, ...] = ()
    words: tuple[str, ...] = ()
    adapter: str | None = None  # a classification LoRA adapter's own head (runtime.model.lora), by its name

    @property
    def is_verbalizer(self) -> bool:
        return self.prompt is not None

    def render(self, text: str) -> str:
        if self.prompt is None:
            return text
        before, after = self.prompt.split(INPUT)
        return before + text + after

    def splice(self, tokens: list[int]) -> list[int]:
        return [*self.prefix_ids, *tokens, *self.suffix_ids]


def adapter_heads(classifiers: tuple[Classifier, ...]) -> set[str]:
    """The LoRA adapters served with their own classification head (each a classifier of its name)."""
    return {c.adapter for c in classifiers if c.adapter}


# ---- declarations ---------------------------------------------------------------------------------------

def parse_classifiers(text: str, source: str) -> tuple[ClassifierSpec, ...]:
    """The classifiers a TOML document declares; ClassifierError (naming `source`) for anything malformed."""
    return declarations.parse_tables(text, source, "classifier", _KEYS, ClassifierError, _spec)


def _spec(table: dict, name: str, where: str) -> ClassifierSpec:
    template = table.get("template")
    if not isinstance(template, str) or template.count(INPUT) != 1:
        raise ClassifierError(f"{where}: `template` must be a string containing {INPUT} exactly once")
    labels = table.get("labels")
    if not isinstance(labels, dict) or len(labels) < 2:
        raise ClassifierError(f"{where}: `labels` must be a table of at least two `label = \"verbalizer word\"`")
    for label, word in labels.items():
        if not isinstance(word, str) or not word:
            raise ClassifierError(f"{where}: label '{label}': the verbalizer word must be a non-empty string")
    chat, prefix = declarations.chat_options(table, where, ClassifierError)
    return ClassifierSpec(name, template, tuple(labels), tuple(labels.values()), chat, prefix)


def load_specs(path: str) -> tuple[ClassifierSpec, ...]:
    """The classifiers declared in the TOML file at `path`; empty: the built-in ones."""
    return declarations.read(path, "SCOREFN_CLASSIFIERS", BUILTIN_TOML, "classifier", parse_classifiers,
                             ClassifierError)


# ---- resolution against the served model -----------------------------------------------------------

def resolve(spec: ClassifierSpec, tokenizer: Any, vocab_size: int, max_labels: int,
            max_label_tokens: int) -> Classifier:
    """The classifier with its prompt rendered and its verbalizers as token IDs; ClassifierError if it cannot be."""
    where = f"classifier '{spec.name}'"
    if len(spec.labels) > max_labels:
        raise ClassifierError(f"{where}: {len(spec.labels)} labels, more than SCOREFN_MAX_LABELS={max_labels}")
    prompt = declarations.render(spec.template, spec.chat, spec.assistant_prefix, tokenizer, where, ClassifierError)
    if prompt.count(INPUT) != 1:
        raise ClassifierError(f"{where}: the chat template did not keep {INPUT} exactly once: {prompt!r}")
    token_ids: list[int | tuple[int, ...]] = []
    for label, word in zip(spec.labels, spec.words):
        token = declarations.verbalizer_tokens(word, tokenizer, vocab_size, max_label_tokens,
                                               f"{where}: label '{label}': verbalizer", ClassifierError)
        if token in token_ids:
            other = spec.labels[token_ids.index(token)]
            raise ClassifierError(f"{where}: labels '{other}' and '{label}' have the same verbalizer token {token}")
        token_ids.append(token)
    # Chat templates write their own special tokens (a BOS among them); tokenizing adds none then, as HF does.
    add_special_tokens = not spec.chat
    before, after = prompt.split(INPUT)
    return Classifier(
        name=spec.name, labels=spec.labels, label_ids=tuple(token_ids), activation="softmax", prompt=prompt,
        add_special_tokens=add_special_tokens,
        prefix_ids=tuple(tokenizer.encode(before, add_special_tokens=add_special_tokens)),
        suffix_ids=tuple(tokenizer.encode(after, add_special_tokens=False)), words=spec.words)


def head_classifier(cfg: Any, model_id: str) -> Classifier:
    """A *ForSequenceClassification checkpoint: its score head's logits, labels from id2label."""
    sigmoid = cfg.num_labels == 1 or getattr(cfg, "problem_type", None) == "multi_label_classification"
    return Classifier(name=model_id, labels=tuple(cfg.id2label), label_ids=tuple(range(cfg.num_labels)),
                      activation="sigmoid" if sigmoid else "softmax")


def build_classifiers(setting: str, cfg: Any, model_id: str, tokenizer: Any, max_labels: int,
                      max_label_tokens: int) -> tuple[Classifier, ...]:
    """The classifiers the engine serves, checked against the loaded model (called at start-up).

    `setting` is SCOREFN_CLASSIFIERS. Declared classifiers that do not fit the model raise ClassifierError;
    the built-in one is dropped with a warning instead (it is written for the embedded model).
    """
    if cfg.task == "sequence_classification":
        if setting:
            raise ClassifierError(
                f"SCOREFN_CLASSIFIERS={setting}: prompt-verbalizer classifiers need a causal language model, "
                f"but the served model is a {cfg.architecture} (its own labels are served on /v1/classify)")
        if cfg.num_labels > max_labels:
            raise ClassifierError(f"{cfg.architecture} '{model_id}' has {cfg.num_labels} labels, more than "
                                  f"SCOREFN_MAX_LABELS={max_labels}")
        return (head_classifier(cfg, model_id),)
    specs = load_specs(setting)
    try:
        return tuple(resolve(spec, tokenizer, cfg.vocab_size, max_labels, max_label_tokens) for spec in specs)
    except ClassifierError as exc:
        if setting:
            raise
        log.warning("built-in classifier dropped (/v1/classify has no classifier; declare one in "
                    "SCOREFN_CLASSIFIERS): %s", exc)
        return ()
