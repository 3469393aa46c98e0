"""POST /v1/classify (vLLM's classification API): request validation, and the response from the engine's scores.

The engine scores classification like /v1/score: one prefill per input, read at its last token. For a
sequence-classification checkpoint the "labels" are its score head's rows (raw logits); for a prompt-verbalizer
classifier they are the verbalizer tokens (log-probabilities, i.e. logits minus a per-input constant, so their
softmax is the softmax of the verbalizer logits).

Order: input (missing, type, empty, token range), truncate_prompt_tokens, use_activation, user, rid, priority,
model, cache_salt; then too_many_items, and after tokenization empty_sequence, context_length_exceeded, too_many_tokens.
A JSON null counts as the field being absent.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

import msgspec
import numpy as np

from handler import schemas
from handler.errors import ERRORS
from handler.http import Scoring, cached, label_values, submit_labels
from handler.validation import (InputsField, cache_salt, check_count, check_sequence, check_total_tokens, decode_inputs,
                                optional, select_named)
from runtime.interface import ScoreResult, ScoringEngine
from runtime.probability import sigmoid, softmax
from runtime.settings import Settings
from runtime.tasks.classifiers import Classifier

_INPUT = InputsField(ERRORS.missing_input, ERRORS.invalid_input_type, ERRORS.input_beyond_int64, ERRORS.empty_input,
                     ERRORS.empty_input_element)


@dataclasses.dataclass(frozen=True)
class ClassifyJob:
    """A validated /v1/classify request, ready for the engine."""
    sequences: list[list[int]]  # one prompt per input, in input order, each non-empty and within the length limit
    label_ids: list[int | tuple[int, ...]]  # the classifier's verbalizers (a tuple: a word of several tokens)
    classifier: Classifier
    use_activation: bool
    model: str  # the classifier's id (or the LoRA adapter's name), answered as `model`
    n_tokens: int  # usage.prompt_tokens
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    cache_salt: str | None = None  # the prefix cache's (runtime.requests.prefix_cache)


def validate_classify_request(request: schemas.ClassifyRequest, engine: ScoringEngine,
                              settings: Settings) -> ClassifyJob:
    inputs, _ = decode_inputs(request.input, _INPUT, engine.vocab_size)
    keep = _truncation(request.truncate_prompt_tokens, engine.max_sequence_length)
    use_activation = optional(request.use_activation, bool, ERRORS.invalid_use_activation_type, True)
    optional(request.user, str, ERRORS.invalid_user_type, None)
    optional(request.rid, str, ERRORS.invalid_rid_type, None)
    optional(request.priority, int, ERRORS.invalid_priority_type, None)
    classifier, adapter = _classifier(request.model, engine)
    adapter = adapter or classifier.adapter  # a classification adapter's own head
    salt = cache_salt(request.cache_salt)

    check_count(len(inputs), settings.max_items, "input")
    sequences = [_prompt(index, value, classifier, engine, keep) for index, value in enumerate(inputs)]
    n_tokens = check_total_tokens(sequences, settings.max_total_tokens, "prompts", "input")
    return ClassifyJob(sequences, list(classifier.label_ids), classifier, use_activation, adapter or classifier.name,
                       n_tokens, adapter, salt)


def classify_response(job: ClassifyJob, result: ScoreResult, engine: ScoringEngine) -> schemas.ClassifyResponse:
    values = label_values(job, result)  # [inputs, labels]: raw logits, or verbalizer log-probabilities
    probs = activate(values, job.classifier.activation) if job.use_activation else values
    labels = job.classifier.labels
    best = values.argmax(axis=1)  # the activations are monotonic: the same label wins either way
    data = [schemas.ClassifyData(index=i, label=labels[best[i]], probs=row, num_classes=len(labels))
            for i, row in enumerate(probs.tolist())]
    return schemas.ClassifyResponse(id=f"classify-{uuid.uuid4().hex}", created=int(time.time()), model=job.model,
                                    data=data, usage=schemas.Usage(
                                        prompt_tokens=job.n_tokens, total_tokens=job.n_tokens,
                                        prompt_tokens_details=cached(result)))


CLASSIFY = Scoring(schemas.CLASSIFY_REQUEST_DECODER, validate_classify_request, submit_labels, classify_response)


def activate(values: np.ndarray, activation: str) -> np.ndarray:
    """Scores to probabilities, per row, in float64 on the host."""
    values = values.astype(np.float64)
    if activation == "sigmoid":
        return sigmoid(values)
    return softmax(values, axis=1)


def model_cards(engine: ScoringEngine, created: int) -> list[schemas.ModelCard]:
    """GET /v1/models: the served model, then each classifier with its labels."""
    if engine.task == "sequence_classification" and engine.classifiers:
        head = engine.classifiers[0]
        return [schemas.ModelCard(id=engine.model_id, created=created, task="classify", labels=list(head.labels))]
    return [schemas.ModelCard(id=engine.model_id, created=created)] + [
        schemas.ModelCard(id=c.name, created=created, parent=engine.model_id, task="classify", labels=list(c.labels))
        for c in engine.classifiers if not c.adapter]


def adapter_cards(engine: ScoringEngine, created: int) -> list[schemas.ModelCard]:
    """GET /v1/models: each LoRA adapter, with the served model as its parent (a classification adapter with its
    labels)."""
    heads = {c.adapter: c for c in engine.classifiers if c.adapter}
    return [schemas.ModelCard(id=name, created=created, parent=engine.model_id, task="lora")
            if name not in heads else schemas.ModelCard(id=name, created=created, parent=engine.model_id,
                                                        task="classify", labels=list(heads[name].labels))
            for name in engine.adapters]


# ---- fields ---------------------------------------------------------------------------------------------

def _truncation(raw: msgspec.Raw, max_length: int) -> int | None:
    """How many trailing tokens of each prompt to keep; None: never truncate."""
    value = optional(raw, int, ERRORS.invalid_truncate_prompt_tokens_type, None)
    if value is None:
        return None
    if value == -1:
        return max_length
    if not 1 <= value <= max_length:
        raise ERRORS.invalid_truncate_prompt_tokens(limit=max_length, value=value)
    return value


def _classifier(raw: msgspec.Raw, engine: ScoringEngine) -> tuple[Classifier, str | None]:
    return select_named(raw, engine.classifiers, engine, "classifier", ERRORS.no_classifier)


def _prompt(index: int, value: str | list[int], classifier: Classifier, engine: ScoringEngine,
            keep: int | None) -> list[int]:
    if isinstance(value, str):
        sequence = list(engine.tokenize(classifier.render(value), add_special_tokens=classifier.add_special_tokens))
    else:
        sequence = classifier.splice(value)
    if keep is not None:
        sequence = sequence[-keep:]  # vLLM's truncate_prompt_tokens: the prompt's last tokens
    check_sequence(sequence, f"input[{index}]", "the prompt", "input", engine, ERRORS.prompt_too_long)
    return sequence
