"""/v1/rerank on real models: one-label sequence-classification heads of every architecture and the embedded
model's built-in verbalizer reranker, against transformers computing the same formula on the same weights; the
query computed once (shared prefix) equals full recomputation."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest
import scipy.special

from handler.core import ScoringCore
from runtime.interface import ScoreResult
from handler.http import HttpRequest, PendingScore
from runtime.model.config import load_config
from runtime.engine import Engine
from runtime.model.loader import load_tokenizer
from runtime.tasks.rerankers import build_rerankers
from runtime.settings import load_settings
from tests.runtime.conftest import scorer_for, small_plan, tiny_served

pytestmark = pytest.mark.slow

# (query, the relevant passage, clearly unrelated ones): the built-in reranker must rank the relevant one first.
CASES = [
    ("What is the capital of France?", "Paris is the capital and largest city of France.",
     ["Bananas are rich in potassium and grow in tropical climates.", "The stock market fell sharply on Monday.",
      "Dogs are loyal pets that love to play fetch."]),
    ("How do plants make food?",
     "Plants make their food by photosynthesis, using sunlight, water and carbon dioxide.",
     ["The Eiffel Tower was built in 1889.", "Basketball is played by two teams of five players.",
      "My laptop battery lasts about six hours."]),
    ("Who wrote Romeo and Juliet?", "Romeo and Juliet is a tragedy written by William Shakespeare.",
     ["Water boils at 100 degrees Celsius at sea level.", "The Pacific is the largest ocean on Earth.",
      "Pizza originated in Naples, Italy."]),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level.",
     ["Romeo and Juliet is a tragedy written by William Shakespeare.", "Cats sleep for most of the day.",
      "The train to Berlin leaves at noon."]),
    ("How many legs does a spider have?", "A spider has eight legs.",
     ["The moon orbits the Earth every 27 days.", "Coffee is made from roasted beans.",
      "Paris is the capital and largest city of France."]),
    ("What is the largest ocean?", "The Pacific Ocean is the largest and deepest ocean on Earth.",
     ["Spiders have eight legs.", "A guitar usually has six strings.", "He bought a new car last week."]),
    ("What do bees make?", "Bees make honey from the nectar of flowers.",
     ["The piano has 88 keys.", "Mount Everest is the highest mountain.", "She went to school by bus."]),
    ("Who painted the Mona Lisa?", "The Mona Lisa was painted by Leonardo da Vinci.",
     ["Penguins live in the Southern Hemisphere.", "The recipe needs two eggs and flour.",
      "Football is popular in Brazil."]),
]


def post(core: ScoringCore, path: str, body: dict) -> tuple[int, dict]:
    outcome = core.begin(HttpRequest("POST", path, {}, json.dumps(body).encode()))
    if isinstance(outcome, PendingScore):
        outcome = core.finish(outcome, outcome.future.result(timeout=120))
    return outcome.status, json.loads(outcome.body)


def by_index(body: dict) -> np.ndarray:
    return np.array([r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])])


class ScorerEngine:
    """The handler's engine interface over a lazily compiled Scorer, synchronously: the real request path
    (validation, pair building, relevance) on a tiny model, compiling only the shapes it meets."""

    def __init__(self, scorer, tokenizer, model_id: str, rerankers) -> None:
        self.scorer, self.tokenizer, self.model_id, self.rerankers = scorer, tokenizer, model_id, rerankers
        self.vocab_size, self.task = scorer.cfg.logit_dim, scorer.cfg.task
        self.max_sequence_length = scorer.plan.max_length
        self.classifiers, self.adapters = (), ()
        self.ready = True

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def submit(self, sequences, label_ids, deadline=None, request_id=None, adapter=None,
               cache_salt=None) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(ScoreResult(self.scorer.score(sequences, label_ids), 0.0, 0.0))
        return future


# ---- kind 1: a one-label *ForSequenceClassification ---------------------------------------------------

@pytest.mark.parametrize("family", ["llama_cls", "qwen2_cls", "qwen3_cls", "gemma_cls"])
def test_head_relevance_matches_transformers_and_shares_the_query(family, tmp_path, embedded_dir):
    import torch

    model = tiny_served(family, tmp_path, embedded_dir, num_labels=1, pad_token_id=0)
    tokenizer = load_tokenizer(tmp_path)
    (reranker,) = build_rerankers("", load_config(tmp_path), "tiny", tokenizer, 16, 8)
    plan = dict(lengths=(16, 32), batches=(1, 8), suffix_lengths=(16, 32), suffix_batches=(4,))
    shared = scorer_for(tmp_path, plan=small_plan(prefix_sharing=True, **plan))
    full = scorer_for(tmp_path, plan=small_plan(prefix_sharing=False, **plan))
    settings = load_settings(environ={})
    worst = 0.0
    for query, relevant, others in CASES[:3]:
        documents = [relevant, *others]
        body = {"query": query, "documents": documents}
        before = shared.prefix_batches
        status, answer = post(ScoringCore(settings, ScorerEngine(shared, tokenizer, "tiny", (reranker,))),
                              "/v1/rerank", body)
        assert status == 200 and answer["model"] == "tiny"
        assert shared.prefix_batches > before  # the query's tokens ran once for all documents
        _, recomputed = post(ScoringCore(settings, ScorerEngine(full, tokenizer, "tiny", (reranker,))),
                             "/v1/rerank", body)
        assert full.prefix_batches == 0
        pairs = [tokenizer.encode(query + document) for document in documents]  # vLLM's pair: the texts joined
        assert answer["usage"]["prompt_tokens"] == sum(map(len, pairs))
        with torch.no_grad():
            logits = np.array([model(torch.tensor([pair])).logits[0, 0].double().item() for pair in pairs])
        expected = scipy.special.expit(logits)  # sigmoid of the one logit
        np.testing.assert_allclose(by_index(answer), expected, atol=1e-4, rtol=0)
        assert np.array_equal(by_index(answer), by_index(recomputed))  # the invariant kernels: sharing moves no bit
        worst = max(worst, float(np.abs(by_index(answer) - expected).max()))
        assert np.ptp(logits) > 0.05  # random weights that still tell the documents apart
        assert [r["index"] for r in answer["results"]] == sorted(range(4), key=lambda i: (-expected[i], i))
    print(f"{family}: max |relevance - transformers| = {worst:.2e}")


# ---- kind 2: the built-in verbalizer reranker on the embedded model -----------------------------------

@pytest.fixture(scope="module")
def embedded_service(cache_dir):
    # Pairs of CASES are at most ~80 tokens; one request's query is shared (context 64), its documents follow.
    settings = load_settings(environ={}, cache_dir=str(cache_dir), dtype="float32", length_buckets=(128,),
                             batch_buckets=(1,), context_buckets=(64,), suffix_length_buckets=(48,),
                             suffix_batch_buckets=(4,), max_labels=4, batch_wait_ms=0.0)
    engine = Engine(settings)
    engine.start()
    yield ScoringCore(settings, engine), engine
    engine.stop(5)


def test_builtin_relevance_ranks_the_relevant_passage_first(embedded_service, torch_embedded):
    import torch

    core, engine = embedded_service
    model, tokenizer = torch_embedded
    (reranker,) = engine.rerankers
    assert reranker.name == "relevance" and reranker.words == (" Yes", " No")
    yes, no = reranker.label_ids
    worst_reference = worst_recomputed = 0.0
    for case, (query, relevant, others) in enumerate(CASES):
        documents = [relevant, *others]
        before = engine.scorer.prefix_batches
        status, body = post(core, "/v1/rerank", {"query": query, "documents": documents})
        assert status == 200 and body["model"] == "relevance"
        assert body["results"][0]["index"] == 0, (query, body["results"])  # the relevant passage first
        assert engine.scorer.prefix_batches > before  # the query ran once for the documents of each slice
        ours = by_index(body)

        pairs = [tokenizer.encode(reranker.render(query, d), add_special_tokens=False) for d in documents]
        assert sum(map(len, pairs)) == body["usage"]["prompt_tokens"]
        ids = torch.zeros((len(pairs), max(map(len, pairs))), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, pair in enumerate(pairs):  # right padding: a causal LM's real positions are unaffected
            ids[row, : len(pair)], mask[row, : len(pair)] = torch.tensor(pair), 1
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits.double()
        last = logits[torch.arange(len(pairs)), torch.tensor([len(p) - 1 for p in pairs])]
        logprobs = torch.log_softmax(last, dim=-1)
        expected = torch.sigmoid(logprobs[:, yes] - logprobs[:, no]).numpy()  # P(yes) / (P(yes) + P(no))
        np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
        worst_reference = max(worst_reference, float(np.abs(ours - expected).max()))
        if case >= 3:  # the ranking on every case; full recomputation (each pair a device batch of its own) on three
            continue
        # full recomputation: each pair alone (one sequence: no prefix to share)
        alone = np.array([engine.score([pair], [yes, no])[0] for pair in pairs], dtype=np.float64)
        np.testing.assert_allclose(ours, scipy.special.expit(alone[:, 0] - alone[:, 1]), atol=1e-4, rtol=0)
        worst_recomputed = max(worst_recomputed, float(np.abs(ours - scipy.special.expit(alone[:, 0] - alone[:, 1]))
                                                   .max()))
    print(f"embedded relevance: max |Δ| vs transformers {worst_reference:.2e}, vs full recomputation "
          f"{worst_recomputed:.2e}")


def test_max_tokens_per_doc_and_models(embedded_service):
    core, engine = embedded_service
    query, relevant, others = CASES[0]
    status, cut = post(core, "/v2/rerank", {"query": query, "documents": [relevant, *others], "max_tokens_per_doc": 2,
                                            "return_documents": False, "top_n": 2})
    assert status == 200 and len(cut["results"]) == 2 and "document" not in cut["results"][0]
    reranker = engine.rerankers[0]
    kept = [reranker.cut(d, 2) for d in [relevant, *others]]  # each document's first two tokens
    for document, text in zip([relevant, *others], kept):
        first_two = engine.tokenize(document, add_special_tokens=False)[:2]
        assert engine.tokenize(text, add_special_tokens=False) == first_two
    pairs = [engine.tokenize(reranker.render(query, d), add_special_tokens=False) for d in kept]
    assert cut["usage"]["prompt_tokens"] == sum(map(len, pairs))
    status, error = post(core, "/v1/rerank", {"query": query, "documents": ["word " * 120]})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    cards = json.loads(core.begin(HttpRequest("GET", "/v1/models", {}, b"")).body)["data"]
    assert [(card["id"], card.get("task")) for card in cards] == [
        ("SmolLM2-135M-Instruct", None), ("sentiment", "classify"), ("relevance", "rerank")]
