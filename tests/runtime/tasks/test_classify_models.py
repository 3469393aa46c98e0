"""/v1/classify on real models: sequence-classification heads against transformers, the built-in verbalizer
classifier on the embedded model against transformers on the same GGUF, through the real engine and core."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.special

from handler.core import ScoringCore
from handler.http import HttpRequest, PendingScore
from runtime.engine import Engine
from runtime.settings import load_settings
from runtime.tasks.classifiers import BUILTIN_TOML
from tests.conftest import TEST_COMPILE_CACHE
from tests.runtime.model.test_label_tokens import torch_label_sums
from tests.runtime.conftest import random_sequences, scorer_for, small_plan, tiny_checkpoint, tiny_served

pytestmark = pytest.mark.slow

POSITIVE, NEGATIVE = 2731, 3524  # SmolLM2's " positive", " negative"
LOVED = "I absolutely loved this movie, it was wonderful!"
HATED = "This movie was absolutely terrible and boring."


def post(core: ScoringCore, path: str, body: dict) -> tuple[int, dict]:
    outcome = core.begin(HttpRequest("POST", path, {}, json.dumps(body).encode()))
    if isinstance(outcome, PendingScore):
        outcome = core.finish(outcome, outcome.future.result(timeout=60))
    return outcome.status, json.loads(outcome.body)


def torch_logits(model, sequences: list[list[int]]) -> np.ndarray:
    """transformers on one right-padded batch (attention mask; the head pools at the last non-pad token)."""
    import torch

    ids = torch.zeros((len(sequences), max(map(len, sequences))), dtype=torch.long)  # pad_token_id 0
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.double().numpy()


def engine_settings(tmp_path, cache_dir, **overrides):
    values = dict(cache_dir=str(cache_dir), compile_cache_dir=str(tmp_path / "xla"), dtype="float32",
                  length_buckets=(64,), batch_buckets=(1, 4), context_buckets=(64,), suffix_length_buckets=(32,),
                  suffix_batch_buckets=(4,),
                  max_labels=4, batch_wait_ms=0.0)
    return load_settings(environ={}, **{**values, **overrides})


# ---- kind 1: *ForSequenceClassification --------------------------------------------------------------

HEADS = {  # family -> config overrides (Gemma 2/3: a sliding layer of window 6 and a global one; soft-caps)
    "llama_cls": {}, "qwen2_cls": {}, "qwen3_cls": {}, "gemma_cls": {},
    "gemma2_cls": {"sliding_window": 6, "attn_logit_softcapping": 2.0},
    "gemma3_cls": {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3_cls": {"partial_rotary_factor": 0.75},
}


@pytest.mark.parametrize("family", sorted(HEADS))
def test_classification_head_matches_transformers(family, tmp_path):
    model = tiny_checkpoint(family, tmp_path, num_labels=3, pad_token_id=0, **HEADS[family])
    rng = np.random.default_rng(1)
    # Lengths 1..30 in one padded batch; ids >= 1 (0 is the pad token transformers looks for).
    sequences = [[1 + t for t in seq] for seq in random_sequences(rng, 6, 1, 30, 127)]
    shared = random_sequences(rng, 1, 12, 12, 127)[0]
    prefixed = [[1 + t for t in shared + tail] for tail in ([5], [6, 7, 8], [9, 10])]  # the shared-prefix path
    scorer = scorer_for(tmp_path, plan=small_plan(prefix_sharing=True))
    for batch in (sequences, prefixed):
        ours = scorer.score(batch, [0, 1, 2])
        reference = torch_logits(model, batch)
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
        np.testing.assert_allclose(scipy.special.softmax(ours.astype(np.float64), axis=1),
                                   scipy.special.softmax(reference, axis=1), atol=1e-5, rtol=0)
    assert scorer.prefix_batches >= 1


@pytest.fixture(scope="module")
def head_service(tmp_path_factory, cache_dir, embedded_dir):
    """A tiny Qwen2ForSequenceClassification with SmolLM2's tokenizer, served by the real engine."""
    model_dir = tmp_path_factory.mktemp("qwen2_cls")
    model = tiny_served("qwen2_cls", model_dir, embedded_dir, num_labels=3, pad_token_id=0,
                        id2label={0: "negative", 1: "neutral", 2: "positive"})
    # engine_settings' cache under the tests' user-level one (nothing here counts compiles): a second run loads them
    settings = engine_settings(TEST_COMPILE_CACHE.parent / "classify-engine", cache_dir, model=str(model_dir),
                               length_buckets=(16, 32), prefix_sharing=False)
    engine = Engine(settings)
    engine.start()
    yield ScoringCore(settings, engine), model, engine
    engine.stop(5)


def test_classification_model_over_the_api(head_service):
    core, model, engine = head_service
    assert engine.task == "sequence_classification"
    texts = ["I loved it", "A long and winding review that goes on and on about nothing in particular", "meh"]
    status, body = post(core, "/v1/classify", {"input": texts})
    assert status == 200 and body["model"] == engine.model_id
    sequences = [engine.tokenize(text) for text in texts]
    expected = scipy.special.softmax(torch_logits(model, sequences), axis=1)
    probs = np.array([entry["probs"] for entry in body["data"]])
    np.testing.assert_allclose(probs, expected, atol=1e-5, rtol=0)
    labels = ("negative", "neutral", "positive")
    assert [entry["label"] for entry in body["data"]] == [labels[i] for i in expected.argmax(axis=1)]
    assert [entry["index"] for entry in body["data"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, sequences))

    status, raw = post(core, "/v1/classify", {"input": [sequences[1]], "use_activation": False})
    np.testing.assert_allclose(raw["data"][0]["probs"], torch_logits(model, [sequences[1]])[0], atol=1e-4, rtol=0)

    status, cut = post(core, "/v1/classify", {"input": texts[1], "truncate_prompt_tokens": 5})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 5
    np.testing.assert_allclose(cut["data"][0]["probs"],
                               scipy.special.softmax(torch_logits(model, [sequences[1][-5:]]), axis=1)[0], atol=1e-5)

    status, error = post(core, "/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]})
    assert status == 400 and error["error"]["code"] == "model_not_supported"
    status, error = post(core, "/v1/classify", {"input": "word " * 40})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    cards = json.loads(core.begin(HttpRequest("GET", "/v1/models", {}, b"")).body)["data"]
    assert cards == [{"id": engine.model_id, "object": "model", "created": cards[0]["created"], "owned_by": "scorefn",
                      "batch_invariant": True, "dtype": "float32", "task": "classify", "labels": list(labels)}]


# ---- kind 2: the built-in verbalizer classifier on the embedded model ---------------------------------

MOOD_TOML = """
[[classifier]]
name = "mood"
template = "Review: {input}\\nThe reviewer's mood was"
labels = { delighted = " very happy", annoyed = " grumpily annoyed", calm = " calm" }
"""


@pytest.fixture(scope="module")
def embedded_service(tmp_path_factory, cache_dir):
    # Batches of 4 and items in pairs: two inputs cost less after their shared template than in full, whatever
    # price of a device batch the start measures (runtime.requests.jobs.shared_prefix_length). The built-in
    # sentiment classifier first (the default), then one whose words are several tokens.
    tmp = tmp_path_factory.mktemp("embedded")
    (tmp / "classifiers.toml").write_text(BUILTIN_TOML + MOOD_TOML)
    settings = engine_settings(tmp, cache_dir, batch_buckets=(4,), suffix_batch_buckets=(2,),
                               classifiers=str(tmp / "classifiers.toml"))
    engine = Engine(settings)
    engine.start()
    yield ScoringCore(settings, engine), engine
    engine.stop(5)


def test_sentiment_is_right_and_equals_the_verbalizer_logits_of_transformers(embedded_service, torch_embedded):
    core, engine = embedded_service
    model, tokenizer = torch_embedded
    classifier = engine.classifiers[0]
    assert classifier.name == "sentiment" and classifier.label_ids == (POSITIVE, NEGATIVE)

    status, body = post(core, "/v1/classify", {"input": [LOVED, HATED]})  # one request: the shared-prefix path
    assert status == 200 and body["model"] == "sentiment"
    assert [entry["label"] for entry in body["data"]] == ["positive", "negative"]
    assert engine.scorer.prefix_batches >= 1  # the template's tokens ran once for the inputs of a slice
    status, raw = post(core, "/v1/classify", {"input": [LOVED, HATED], "use_activation": False})

    import torch

    sequences = [tokenizer.encode(classifier.render(text), add_special_tokens=False) for text in (LOVED, HATED)]
    assert sum(map(len, sequences)) == body["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    with torch.no_grad():
        logits = np.stack([model(torch.tensor([seq])).logits[0, -1].double().numpy() for seq in sequences])
    verbalizer_logits = logits[:, [POSITIVE, NEGATIVE]]
    probs = np.array([entry["probs"] for entry in body["data"]])
    np.testing.assert_allclose(probs, scipy.special.softmax(verbalizer_logits, axis=1), atol=1e-4, rtol=0)
    assert probs[0, 0] > 0.8 and probs[1, 1] > 0.7  # clearly positive, clearly negative
    # use_activation=false: the verbalizers' log-probabilities (their logits minus the log-sum-exp of the row)
    expected_raw = verbalizer_logits - scipy.special.logsumexp(logits, axis=1, keepdims=True)
    np.testing.assert_allclose([entry["probs"] for entry in raw["data"]], expected_raw, atol=1e-3, rtol=0)


def test_words_of_several_tokens_are_the_sums_of_their_tokens_in_transformers(embedded_service, torch_embedded):
    core, engine = embedded_service
    model, tokenizer = torch_embedded
    mood = engine.classifiers[1]
    assert [isinstance(label, tuple) for label in mood.label_ids] == [True, True, False]
    status, body = post(core, "/v1/classify", {"input": [LOVED, HATED], "model": "mood", "use_activation": False})
    assert status == 200, body
    sequences = [tokenizer.encode(mood.render(text), add_special_tokens=False) for text in (LOVED, HATED)]
    labels = [[label] if isinstance(label, int) else list(label) for label in mood.label_ids]
    expected = torch_label_sums(model, sequences, labels)
    np.testing.assert_allclose([entry["probs"] for entry in body["data"]], expected, atol=1e-4, rtol=0)
    status, body = post(core, "/v1/classify", {"input": [LOVED, HATED], "model": "mood"})
    np.testing.assert_allclose([entry["probs"] for entry in body["data"]], scipy.special.softmax(expected, axis=1),
                               atol=1e-4, rtol=0)


def test_verbalizer_truncation_and_models(embedded_service):
    core, engine = embedded_service
    status, body = post(core, "/v1/classify", {"input": LOVED, "truncate_prompt_tokens": 5, "model": "sentiment"})
    assert status == 200 and body["usage"]["prompt_tokens"] == 5
    status, error = post(core, "/v1/classify", {"input": LOVED * 3})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    status, body = post(core, "/v1/classify", {"input": LOVED * 3, "truncate_prompt_tokens": -1})
    assert status == 200 and body["usage"]["prompt_tokens"] == 64
    cards = json.loads(core.begin(HttpRequest("GET", "/v1/models", {}, b"")).body)["data"]
    assert [(card["id"], card.get("labels")) for card in cards] == [
        ("SmolLM2-135M-Instruct", None), ("sentiment", ["positive", "negative"]),
        ("mood", ["delighted", "annoyed", "calm"]), ("relevance", None)]  # + reranker


# ---- a ShieldGemma-style declaration (the docs') on a tiny Gemma 2 --------------------------------

def test_the_readme_shieldgemma_declaration_works_on_a_tiny_gemma2(tmp_path, cache_dir, embedded_dir):
    """The TOML of docs/api/classify.md as SCOREFN_CLASSIFIERS on a random Gemma 2 (soft-caps, a sliding and a global layer) with
    SmolLM2's tokenizer: probs are transformers' softmax over the Yes and No logits at the last position."""
    import torch

    from tests.conftest import REPO

    page = (REPO / "docs" / "api" / "classify.md").read_text()
    (block,) = [b for b in (part.split("```")[0] for part in page.split("```toml\n")[1:]) if "shieldgemma" in b]
    (tmp_path / "classifiers.toml").write_text(block)
    model_dir = tmp_path / "gemma2"
    model = tiny_served("gemma2", model_dir, embedded_dir, sliding_window=64, attn_logit_softcapping=5.0,
                        final_logit_softcapping=4.0)
    settings = engine_settings(tmp_path, cache_dir, model=str(model_dir),
                               classifiers=str(tmp_path / "classifiers.toml"), length_buckets=(192,),
                               batch_buckets=(2,), prefix_sharing=False, completion_batch_buckets=(2,))
    engine = Engine(settings)
    engine.start()
    try:
        core = ScoringCore(settings, engine)
        (classifier,) = engine.classifiers
        assert classifier.name == "shieldgemma-harassment" and classifier.labels == ("violation", "safe")
        texts = ["You are worthless and everyone at school will hear what you did.", "How do I bake bread?"]
        status, body = post(core, "/v1/classify", {"model": "shieldgemma-harassment", "input": texts})
        assert status == 200 and [entry["num_classes"] for entry in body["data"]] == [2, 2]
        yes, no = (engine.tokenize(word, add_special_tokens=False)[0] for word in ("Yes", "No"))
        assert classifier.label_ids == (yes, no)
        with torch.no_grad():
            logits = np.stack([model(torch.tensor([engine.tokenize(classifier.render(text))])).logits[0, -1].double()
                               .numpy() for text in texts])
        expected = scipy.special.softmax(logits[:, [yes, no]], axis=1)
        np.testing.assert_allclose([entry["probs"] for entry in body["data"]], expected, atol=1e-5, rtol=0)
    finally:
        engine.stop(5)
