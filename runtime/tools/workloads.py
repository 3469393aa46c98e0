"""The benchmark's workloads (runtime.tools.bench measures them, runtime.tools.roofline bounds them): seeded token IDs,
so no tokenizer, GGUF file or model hub is needed.

W1: a 15-token query, items of ~8 tokens, 3 labels; 1, 32 and 256 items per request (1 item: single-item latency).
W2: one long query x many 20-token items, 1 label: 1000x100, and 2000x500 (the peers' published shape).
W4: 64 prompts of 256 tokens, every position's log-probability and top 5 (as /v1/completions echoes them).
W5: reranking, as the built-in yes/no reranker lays a pair out: template head, a 64-token query, 100 documents of
100 tokens, template tail, yes/no labels.
W6: multiple choice at scale: a 200-token query, 100 items of 20 tokens, 4 labels (answer texts) of 2-8 tokens.
W7: a few-shot classifier: a fixed 1,500-token prompt, one 30-token input and a 4-token cue per request, 2 labels;
100 requests (the prefix cache's workload).
W8: lm-evaluation-harness's multiple choice as `local-completions` sends it: 25 questions of 600 tokens (a few-shot
prompt), 4 answers of 2-12 tokens each, one prompt per answer read at every position (echo), one at a time.
Batch: W1-256 as a batch file, each line one W1-256 request (`scorefn batch` in process, against W1-256's figure).
LoRA: 8 seeded random adapters of rank 16 on every projection; W1-256 as 8 requests of 32 items, one adapter each
(one device round mixes them), and W2 with one adapter, against the base model on the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from runtime.interface import Sampling
from runtime.model.lora import Adapter
from runtime.requests.jobs import Job, TokenJob

QWEN3_CONFIG = Path(__file__).resolve().parent.parent / "model" / "configs" / "qwen3-0.6b.json"
W1_SIZES = (1, 32, 256)
W1_QUERY, W1_ITEM = 15, 8  # tokens (RFC-000's table: a short classification prompt, short items)
W2_SIZES = {"w2": (1000, 100, 20), "w2_peer": (2000, 500, 20)}  # query tokens, items, item tokens
W4_SIZE = (64, 256, 5)  # prompts, tokens each, top alternatives per position (echo + logprobs)
W5_SIZE = (27, 64, 100, 100, 22)  # head tokens, query tokens, documents, document tokens, tail tokens
W6_SIZE = (200, 100, 20, (2, 4, 6, 8))  # query tokens, items, item tokens, each label's tokens
W7_SIZE = (1500, 30, 4, 100)  # prompt tokens, input tokens, cue tokens, requests
W8_SIZE = (600, 4, 25)  # question tokens, answers per question, questions
W9_SIZE = (1200, 100, 32, 6)  # instruction tokens, profile tokens, items of 10 tokens a page, members
LORA_SIZE = (8, 16, 8)  # adapters, rank, requests W1-256 is split into
BATCH_LINES = 16  # W1-256 requests in the batch file
FIRST_ID = 100  # generated token IDs avoid the low IDs most vocabularies reserve for special tokens


def token_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, n).tolist()


def w1_request(vocab: int, items: int, seed: int = 1) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    query = token_ids(rng, vocab, W1_QUERY)
    lengths = rng.integers(W1_ITEM - 2, W1_ITEM + 3, items)
    return [query + token_ids(rng, vocab, int(n)) for n in lengths], token_ids(rng, vocab, 3)


def w1_batch_file(vocab: int, items: int, lines: int) -> str:
    """W1 requests of `items` items as an OpenAI batch file (token IDs: the query, then each item's own tokens)."""
    out = []
    for line in range(lines):
        sequences, labels = w1_request(vocab, items, seed=100 + line)
        body = {"query": sequences[0][:W1_QUERY], "items": [s[W1_QUERY:] for s in sequences],
                "label_token_ids": labels}
        out.append(json.dumps({"custom_id": f"w1-{line}", "method": "POST", "url": "/v1/score", "body": body}))
    return "\n".join(out) + "\n"


def w2_request(vocab: int, query_tokens: int, items: int, item_tokens: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(2)
    return token_ids(rng, vocab, query_tokens), [token_ids(rng, vocab, item_tokens) for _ in range(items)]


def random_adapters(shapes: dict[str, tuple[int, int]], layers: int, count: int, rank: int,
                    seed: int = 6) -> list[Adapter]:
    """`count` LoRA adapters of `rank` on every projection (runtime.model.lora's [I, O] shapes), small random A and B."""
    rng = np.random.default_rng(seed)

    def update(inputs: int, outputs: int) -> tuple[np.ndarray, np.ndarray]:
        return (rng.standard_normal((inputs, rank)).astype(np.float32) * 0.02,
                rng.standard_normal((rank, outputs)).astype(np.float32) * 0.02)
    return [Adapter(f"adapter-{a}", Path(), rank, {(layer, name): update(*shape) for layer in range(layers)
                                                   for name, shape in shapes.items()}) for a in range(count)]


def w4_prompts(vocab: int, prompts: int, tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [token_ids(rng, vocab, tokens) for _ in range(prompts)]


def w5_request(vocab: int, head: int, query: int, documents: int, document_tokens: int, tail: int
               ) -> tuple[list[int], list[list[int]], list[int]]:
    """(the pairs' shared head and query, each document with the template's tail, the yes and no labels)."""
    rng = np.random.default_rng(5)
    prefix, end = token_ids(rng, vocab, head + query), token_ids(rng, vocab, tail)
    rests = [token_ids(rng, vocab, document_tokens) + end for _ in range(documents)]
    return prefix, rests, token_ids(rng, vocab, 2)


def w6_request(vocab: int, query_tokens: int, items: int, item_tokens: int, label_tokens: tuple[int, ...]
               ) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(the query, each item's own tokens, the labels' tokens)."""
    rng = np.random.default_rng(6)
    query = token_ids(rng, vocab, query_tokens)
    return query, [token_ids(rng, vocab, item_tokens) for _ in range(items)], \
        [token_ids(rng, vocab, n) for n in label_tokens]


def w7_requests(vocab: int, prompt_tokens: int, input_tokens: int, cue_tokens: int, requests: int
                ) -> list[list[int]]:
    """Each request's one sequence: the fixed prompt, its own input, the cue (`Sentiment:`)."""
    rng = np.random.default_rng(7)
    prompt, cue = token_ids(rng, vocab, prompt_tokens), token_ids(rng, vocab, cue_tokens)
    return [prompt + token_ids(rng, vocab, input_tokens) + cue for _ in range(requests)]


def w8_prompts(vocab: int, question_tokens: int, answers: int, questions: int) -> list[list[int]]:
    """Each question's prompts, question by question: the question, then one answer of 2-12 tokens."""
    rng = np.random.default_rng(8)
    out = []
    for _ in range(questions):
        question = token_ids(rng, vocab, question_tokens)
        out += [question + token_ids(rng, vocab, int(rng.integers(2, 13))) for _ in range(answers)]
    return out


def workloads(vocab: int) -> dict[str, tuple[list, str]]:
    """name -> (jobs, unit): every workload at its full size."""
    out: dict[str, tuple[list, str]] = {}
    for n in W1_SIZES:
        sequences, labels = w1_request(vocab, n)
        out[f"w1_{n}"] = ([Job(sequences, labels)], "items")
    for name, (query_tokens, items, item_tokens) in W2_SIZES.items():
        query, rests = w2_request(vocab, query_tokens, items, item_tokens)
        out[name] = ([Job([query + rest for rest in rests], [FIRST_ID])], "items")
    prompts, tokens, _ = W4_SIZE
    out["w4"] = ([TokenJob(w4_prompts(vocab, prompts, tokens), [Sampling()] * prompts)], "prompts")
    prefix, rests, labels = w5_request(vocab, *W5_SIZE)
    out["w5"] = ([Job([prefix + rest for rest in rests], labels)], "documents")
    return out
