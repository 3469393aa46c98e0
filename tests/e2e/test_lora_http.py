"""LoRA adapters through a real `scorefn serve` (SCOREFN_LORA_ADAPTERS) and real clients: PEFT adapters of a tiny
random Llama (SmolLM2's tokenizer) served beside it; each request names one with `model`; scores match transformers +
PEFT; requests of different adapters running together get the bits each gets alone."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from runtime.tools.serverproc import ServerProcess
from tests.e2e.conftest import FUNCTIONAL
from tests.conftest import peft_adapter, peft_classifier, torch_label_logprobs
from tests.runtime.conftest import tiny_served

pytestmark = pytest.mark.slow
ADAPTERS = ("tox", "pii")
QUERY = [1, 504, 2000, 31, 77, 4096, 12]
ITEMS = [[310, 42], [7000, 8, 9, 10], [45000], [3, 3, 3]]
LABELS = [5, 900, 20000]


@pytest.fixture(scope="module")
def served(tmp_path_factory, embedded_dir):
    """(the server, PEFT references: the base model, then each adapter)."""
    root = tmp_path_factory.mktemp("lora-e2e")
    base = tiny_served("llama", root / "base", embedded_dir, tie_word_embeddings=True)
    references = [base, peft_adapter(base, root / "tox", 1, 8, ["q_proj", "v_proj", "down_proj"]),
                  peft_adapter(base, root / "pii", 2, 4, ["o_proj", "up_proj"], rslora=True),
                  peft_classifier(root / "base", root / "judge", 3, 3, 8, ["q_proj", "v_proj", "up_proj"])]
    rerankers = root / "rerankers.toml"
    rerankers.write_text('[[reranker]]\nname = "relevance"\nyes = " Yes"\nno = " No"\n'
                         'template = "Query: {query}\\nDocument: {document}\\nRelevant:"\n')
    adapters = ",".join(f"{name}={root / name}" for name in (*ADAPTERS, "judge"))
    env = {**FUNCTIONAL, "SCOREFN_MODEL": str(root / "base"), "SCOREFN_RERANKERS": str(rerankers),
           "SCOREFN_COMPILE_CACHE_DIR": str(root / "xla"), "SCOREFN_LORA_ADAPTERS": adapters}
    with ServerProcess(env=env) as server:
        yield server, references


def score(url: str, model: str | None) -> np.ndarray:
    body = {"query": QUERY, "items": ITEMS, "label_token_ids": LABELS} | ({"model": model} if model else {})
    reply = httpx.post(f"{url}/v1/score", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == (model or "base")
    return np.asarray(reply.json()["scores"])


def test_each_adapter_scores_as_transformers_and_peft(served):
    server, references = served
    sequences = [QUERY + item for item in ITEMS]
    for model, reference in zip((None, *ADAPTERS), references[:3]):
        expected = torch_label_logprobs(reference, sequences, LABELS)
        np.testing.assert_allclose(score(server.url, model), expected, atol=1e-4, rtol=0)


def test_adapters_mixed_under_concurrent_load_keep_their_bits(served):
    server, _ = served
    alone = {model: score(server.url, model) for model in (None, *ADAPTERS)}
    assert not np.allclose(alone["tox"], alone[None], atol=1e-3)  # the adapters change the scores
    models = [None, *ADAPTERS] * 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for model, together in zip(models, pool.map(lambda m: score(server.url, m), models)):
            assert np.array_equal(together, alone[model]), model


def test_real_clients_name_adapters(served):
    server, _ = served
    openai = pytest.importorskip("openai")
    cohere = pytest.importorskip("cohere")
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models if m.get("task") == "lora"] == [("tox", "base"), ("pii", "base")]
    assert [m for m in models if m["id"] == "judge"][0]["labels"] == ["LABEL_0", "LABEL_1", "LABEL_2"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused") as client:
        echoed = [client.completions.create(model=model, prompt="The capital of France is", max_tokens=0, echo=True,
                                            logprobs=1) for model in ("base", "tox")]
        assert [e.model for e in echoed] == ["base", "tox"]
        assert echoed[0].choices[0].logprobs.token_logprobs[1:] != echoed[1].choices[0].logprobs.token_logprobs[1:]
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="toxic", prompt="x", max_tokens=0, echo=True, logprobs=1)
        assert caught.value.code == "model_not_found" and "'tox', 'pii'" in str(caught.value)
    with cohere.ClientV2(api_key="unused", base_url=server.url) as co:
        reranked = co.rerank(model="pii", query="capital of France", documents=["Paris", "a cat", "Lyon"])
        assert sorted(r.index for r in reranked.results) == [0, 1, 2]


def test_a_classification_adapter_classifies_as_peft(served):
    """PEFT's SEQ_CLS adapter (LoRA and its own head) on /v1/classify: its probabilities are the softmax of PEFT's
    logits at the last token."""
    import torch

    server, references = served
    inputs = [QUERY + item for item in ITEMS]
    reply = httpx.post(f"{server.url}/v1/classify", json={"model": "judge", "input": inputs}, timeout=60)
    assert reply.status_code == 200, reply.text
    with torch.no_grad():
        logits = np.stack([references[3](torch.tensor([s])).logits[0].numpy() for s in inputs])
    expected = np.exp(logits - logits.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose([row["probs"] for row in reply.json()["data"]], expected, atol=1e-4, rtol=0)
    assert reply.json()["model"] == "judge"
