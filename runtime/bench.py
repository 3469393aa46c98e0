"""`scorefn bench`: scorefn against the baseline a user would otherwise write, on this machine, same weights.

Baseline: transformers (PyTorch) scoring each request as one left-padded batch of full sequences with
`logits_to_keep=1`, in bfloat16 and float32 (`torch.set_flush_denormal(True)`).
Workloads: W1 (RFC-000's table: ~14-token query, ~8-token items, 3 labels, 1/8/16/32 items per request),
W2 (1000-token shared query, 100 items of 20 tokens, 1 label), W3 (32 concurrent HTTP clients sending
one-item requests vs. one client at a time). The last output line is one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from runtime.scorer import common_prefix_length
from runtime.settings import load_settings

QUERY = "Review: the room was clean and close to the station. Sentiment:"  # 15 tokens
ITEMS = [f" The {adj} staff {verb} us at the {place}." for adj, verb, place in zip(
    ["friendly", "rude", "busy", "calm", "young", "old", "kind", "tired"] * 4,
    ["greeted", "ignored", "helped", "thanked", "welcomed", "served", "called", "found"] * 4,
    ["door", "desk", "bar", "pool", "gate", "lobby", "lift", "park", "cafe", "shop", "hall", "spa",
     "gym", "inn", "beach", "port"] * 2)]
LABELS_W1 = [" positive", " negative", " neutral"]
LONG_TEXT = ("The history of the city stretches back over two thousand years, from a small river settlement "
             "to a centre of trade, learning and government. Its markets drew merchants from distant coasts, "
             "its scholars argued in crowded halls, and its rulers built walls, bridges and palaces. ")


# ---- measurement helpers -----------------------------------------------------------------------------------

def timed_runs(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def summarize(latencies: list[float], items: int) -> dict:
    lat = np.asarray(latencies)
    return {"items_per_s": items * len(lat) / lat.sum(), "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def bf16_matmul_peak() -> float:
    """GFLOP/s of a model-shaped bfloat16 matmul with float32 accumulation (the MFU denominator)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2048, 576), jnp.bfloat16)
    w = jnp.ones((576, 1536), jnp.bfloat16)
    f = jax.jit(lambda x, w: jnp.einsum("mi,io->mo", x, w, preferred_element_type=jnp.float32))
    seconds = np.median(timed_runs(lambda: f(x, w).block_until_ready(), 20, warmup=2))
    return 2 * 2048 * 576 * 1536 / seconds / 1e9


def sequence_flops(cfg, tokens: int, start: int = 0) -> float:
    """Forward FLOPs of `tokens` tokens at positions start.. (causal attention), plus one vocabulary row."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (tokens * start + tokens * (tokens + 1) / 2)
    return tokens * 2.0 * cfg.non_embedding_params() + attention + 2.0 * cfg.hidden_size * cfg.vocab_size


# ---- the two systems -----------------------------------------------------------------------------------------

class TorchBaseline:
    def __init__(self, model_dir: Path, dtype: str, pad_id: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_flush_denormal(True)
        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.pad_id = pad_id
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()

    def score(self, sequences: list[list[int]], labels: list[int]):
        torch = self.torch
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):  # left padding: the last position is every row's last token
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
            return torch.log_softmax(logits[:, -1].float(), dim=-1)[:, labels].numpy()


def scorefn_scorer(model_dir: Path, dtype: str, settings):
    from runtime.config import load_config
    from runtime.engine import bucket_plan
    from runtime.model import Llama
    from runtime.scorer import Scorer
    from runtime.weights import load_arrays

    cfg = load_config(model_dir)
    return Scorer(Llama(cfg, load_arrays(model_dir, cfg), dtype), bucket_plan(settings), lazy=True)


def random_checkpoint(config_path: str, out_dir: Path) -> Path:
    """A Hugging Face directory with random weights for a config.json (e.g. Qwen3-0.6B-shaped)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_path)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


# ---- workloads -----------------------------------------------------------------------------------------------

def w1_requests(tokenizer, vocab: int):
    labels = [tokenizer.encode(text, add_special_tokens=False)[0] % vocab for text in LABELS_W1]
    sequences = [[t % vocab for t in tokenizer.encode(QUERY + item)] for item in ITEMS]
    return sequences, labels


def w2_request(tokenizer, vocab: int, query_tokens: int, items: int, item_tokens: int):
    text_ids = tokenizer.encode(LONG_TEXT * 40)
    query = [t % vocab for t in text_ids[:query_tokens]]
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text_ids) - item_tokens, items)
    return [query + [t % vocab for t in text_ids[s:s + item_tokens]] for s in starts], [text_ids[0] % vocab]


async def _http_clients(url: str, clients: int, seconds: float, body: dict) -> list[float]:
    import httpx

    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def client(http):
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            response = await http.post(url + "/v1/score", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies


def _engine_counter(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + " ", name + "_total ")):  # counters carry the _total suffix
            return float(line.split()[1])
    return 0.0


def run_w3(seconds: float, clients: int, env: dict[str, str]) -> dict:
    from runtime.serverproc import ServerProcess

    body = {"query": QUERY, "items": [ITEMS[0]], "label_token_ids": [2731, 3524]}
    with ServerProcess(env=env) as server:
        asyncio.run(_http_clients(server.url, 1, 1.0, body))  # connection set-up, first requests
        result = {}
        for name, n in (("serial", 1), ("concurrent", clients)):
            batches = _engine_counter(server.url, "scorefn_engine_device_batches")
            rows = _engine_counter(server.url, "scorefn_engine_device_batch_sequences")
            latencies = asyncio.run(_http_clients(server.url, n, seconds, body))
            batches = _engine_counter(server.url, "scorefn_engine_device_batches") - batches
            rows = _engine_counter(server.url, "scorefn_engine_device_batch_sequences") - rows
            result[name] = {"items_per_s": len(latencies) / seconds,
                            "p50_ms": float(np.percentile(latencies, 50) * 1e3),
                            "p99_ms": float(np.percentile(latencies, 99) * 1e3),
                            "mean_device_batch": rows / batches if batches else 0.0}
    return result


# ---- main ----------------------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    from runtime.loader import load_tokenizer, resolve_model_dir

    settings = load_settings()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per W3 request otherwise
    smoke = getattr(args, "smoke", False)  # the test suite's run: every code path, minimal sizes
    quick = args.quick or smoke
    repeats = 2 if smoke else 5 if quick else 20
    report: dict = {"dtype": settings.dtype, "cpus": os.cpu_count()}
    tmp = tempfile.TemporaryDirectory(prefix="scorefn-bench-")
    embedded_dir, _ = resolve_model_dir("", settings.cache_dir)
    tokenizer = load_tokenizer(embedded_dir)
    model_dir = random_checkpoint(args.model_config, Path(tmp.name)) if args.model_config else embedded_dir
    scorer = scorefn_scorer(model_dir, settings.dtype, settings)
    cfg, vocab = scorer.cfg, scorer.cfg.vocab_size
    report["model"] = f"{cfg.architecture} {cfg.num_layers}L d{cfg.hidden_size}" + (
        " (random weights)" if args.model_config else " (embedded SmolLM2-135M-Instruct)")
    peak = bf16_matmul_peak()
    report["bf16_matmul_peak_gflops"] = peak
    print(f"model: {report['model']}, dtype {settings.dtype}, bf16 matmul peak {peak:.0f} GFLOP/s", flush=True)

    baselines = {}
    if not args.skip_torch:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        baselines = {dt: TorchBaseline(model_dir, dt, pad % vocab) for dt in ("bfloat16", "float32")}

    sequences, labels = w1_requests(tokenizer, vocab)
    rows = []
    for n in (1, 8, 16, 32):
        request = sequences[:n]
        # FLOPs the math needs: a shared prefix counts once (as scorefn computes it), so MFU is not flattered.
        shared = min(common_prefix_length(request), min(len(s) for s in request) - 1) if n > 1 else 0
        flops = sequence_flops(cfg, shared) + sum(sequence_flops(cfg, len(s) - shared, shared) for s in request)
        ours = summarize(timed_runs(lambda: scorer.score(request, labels), repeats), n)
        ours["gflops"] = flops * ours["items_per_s"] / n / 1e9
        entry = {"items": n, "scorefn": ours}
        for dt, baseline in baselines.items():
            entry[f"torch_{dt}"] = summarize(timed_runs(lambda: baseline.score(request, labels),
                                                        max(2, repeats // 4)), n)
        rows.append(entry)
        line = f"W1 {n:>2} items: scorefn {ours['items_per_s']:8.1f} items/s p50 {ours['p50_ms']:7.1f} ms " \
               f"p99 {ours['p99_ms']:7.1f} ms"
        for dt in baselines:
            line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:7.1f} items/s"
        print(line, flush=True)
    report["w1"] = rows

    query_tokens, n_items = (2000, 500) if args.model_config and not quick else (200, 10) if smoke else (1000, 100)
    w2_sequences, w2_labels = w2_request(tokenizer, vocab, query_tokens, n_items, 20)
    w2_flops = sequence_flops(cfg, query_tokens) + n_items * sequence_flops(cfg, 20, query_tokens)
    w2 = summarize(timed_runs(lambda: scorer.score(w2_sequences, w2_labels), 2 if quick else 3), n_items)
    w2["gflops"] = w2_flops * w2["items_per_s"] / n_items / 1e9
    report["w2"] = {"query_tokens": query_tokens, "items": n_items, "scorefn": w2}
    line = f"W2 {query_tokens}-token query x {n_items} items: scorefn {w2['items_per_s']:.1f} items/s"
    subset = 2 if smoke else 8 if quick else 20  # the baseline's cost is linear in items (no sharing): a subset
    for dt, baseline in baselines.items():
        report["w2"][f"torch_{dt}"] = summarize(
            timed_runs(lambda: baseline.score(w2_sequences[:subset], w2_labels), 1, warmup=0), subset)
        line += f" | torch {dt} {report['w2'][f'torch_{dt}']['items_per_s']:.2f} items/s ({subset}-item batch)"
    print(line, flush=True)

    if not args.skip_http and not args.model_config:
        env = {"SCOREFN_LENGTH_BUCKETS": "32,64", "SCOREFN_BATCH_BUCKETS": "1,2,4,8,16,32",
               "SCOREFN_SUFFIX_LENGTH_BUCKETS": "16", "SCOREFN_SUFFIX_BATCH_BUCKETS": "8",
               "SCOREFN_MAX_LABELS": "16", "SCOREFN_DTYPE": settings.dtype}
        report["w3"] = run_w3(1.0 if smoke else 4.0 if quick else 15.0, 32, env)
        for name, row in report["w3"].items():
            print(f"W3 {name:10}: {row['items_per_s']:7.1f} items/s p50 {row['p50_ms']:7.1f} ms "
                  f"p99 {row['p99_ms']:7.1f} ms mean device batch {row['mean_device_batch']:.1f}", flush=True)

    def ratio(a, b):
        return round(a / b, 3) if b else None

    w1_32 = rows[-1]
    summary = {
        "w1_32_items_per_s": round(w1_32["scorefn"]["items_per_s"], 1),
        "w2_items_per_s": round(w2["items_per_s"], 1),
        "w1_32_vs_torch_bf16": ratio(w1_32["scorefn"]["items_per_s"],
                                     w1_32.get("torch_bfloat16", {}).get("items_per_s", 0)),
        "w1_32_vs_torch_fp32": ratio(w1_32["scorefn"]["items_per_s"],
                                     w1_32.get("torch_float32", {}).get("items_per_s", 0)),
        "w2_vs_torch_bf16": ratio(w2["items_per_s"], report["w2"].get("torch_bfloat16", {}).get("items_per_s", 0)),
        "w2_vs_torch_fp32": ratio(w2["items_per_s"], report["w2"].get("torch_float32", {}).get("items_per_s", 0)),
        "w3_concurrent_vs_serial": ratio(report["w3"]["concurrent"]["items_per_s"],
                                         report["w3"]["serial"]["items_per_s"]) if "w3" in report else None,
        "mfu_w1_32": round(w1_32["scorefn"]["gflops"] / peak, 3),
        "mfu_w2": round(w2["gflops"] / peak, 3),
        "dtype": settings.dtype,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**report, "summary": summary}, indent=2))
    tmp.cleanup()
    print(json.dumps(summary), flush=True)
    return 0
