"""`scorefn bench`: scorefn against what a user would otherwise write, on this machine, same weights, same run.

Model: SCOREFN_MODEL (default: the embedded SmolLM2-135M-Instruct) on a CPU; on an accelerator (or with --model-config) seeded random
weights from a config.json, Qwen3-0.6B-shaped by default (runtime/model/configs/qwen3-0.6b.json). Token IDs are
generated (seeded), so no tokenizer, GGUF file or model hub is needed: the runtime's dependencies plus PyTorch.
Baselines (runtime.tools.baselines, on CUDA when PyTorch sees a GPU): transformers scoring full sequences, and
transformers with the query's KV cache computed once and reused (W2).
Workloads: W1 (a 15-token query, items of ~8 tokens, 3 labels; 1, 32 and 256 items per request; 1 item is the
single-item latency), W2 (one long query x many 20-token items, 1 label: 1000x100, and 2000x500 on
accelerators or with --peer), W3 (concurrent HTTP clients vs one at a time, and with tracing on vs off; CPU,
embedded model), W4 (64 prompts of 256 tokens: every position's log-probability and top 5, as /v1/completions echoes them), W5
(reranking: a 64-token query and 100 documents of 100 tokens in the reranker's template, yes/no labels, prefix
sharing on and off), W6 (multiple choice: a 200-token query, 100 items of 20 tokens, 4 labels of 2-8 tokens, as
label rows; against transformers scoring each (prompt, label) sequence, and with each prompt's KV cache reused for
its labels), Batch (W1-256 as a batch file of W1-256 lines through `scorefn batch` in process, its engine
started before the clock, against W1-256's figure of the same run). Every scorefn figure but W3 comes with
`invariance_cost`: its time with the batch-invariant kernels over without (SCOREFN_BATCH_INVARIANT), alternating
runs in the same process.
MFU is against the device's matmul peak measured in the same run: bfloat16 on an accelerator; on a CPU the faster
of bfloat16 and float32 (without bfloat16 instructions float32 is the faster). --compile-times measures the default bucket set's
warm-up cold and from the persistent cache, each in a fresh process. The last output line is one JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import httpx
import jax
import jax.numpy as jnp

from runtime.model import lora
from runtime.model.config import config_from_hf, load_config
from runtime.model.loader import load_model, resolve_model_dir
from runtime.assembly import platform as platforms
from runtime.assembly import startup
from runtime.assembly.compose import compose
from runtime.requests.jobs import Job, label_rows, label_scores, shareable_prefix
from runtime.assembly.store import cache_events, enable_persistent_cache
from runtime.settings import load_settings
from runtime.tools.baselines import TorchScorer, random_checkpoint
from runtime.tools.roofline import padding_report, roofline_report
from runtime.tools.otlp_receiver import OtlpReceiver
from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess, scorefn_command
from runtime.tools.workloads import (BATCH_LINES, FIRST_ID, LORA_SIZE, QWEN3_CONFIG, W1_SIZES, W2_SIZES, W4_SIZE,
                                     W5_SIZE, W6_SIZE, random_adapters, w1_batch_file, w1_request, w2_request,
                                     w4_prompts, w5_request, w6_request)



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


def invariance_cost(scorers, run, runs: int) -> float:
    """Median time of `run(scorer)` with the batch-invariant kernels over without (scorers: (invariant, not)),
    alternating runs in this process so that both see the same machine."""
    times: list[list[float]] = [[], []]
    for scorer in scorers:
        run(scorer)  # compiles its buckets
    for _ in range(runs):
        for kind, scorer in enumerate(scorers):
            started = time.perf_counter()
            run(scorer)
            times[kind].append(time.perf_counter() - started)
    return round(float(np.median(times[0]) / np.median(times[1])), 3)


def summarize(latencies: list[float], items: int) -> dict:
    lat = np.asarray(latencies)
    return {"items_per_s": items * len(lat) / lat.sum(), "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def matmul_peak(accelerator: bool) -> tuple[float, str, dict[str, float]]:
    """(GFLOP/s, dtype, GFLOP/s by dtype) of the fastest matmul with float32 accumulation: bfloat16 8192^3 on an
    accelerator; on a CPU the platform's model-shaped probe (2048x576 @ 576x1536), bfloat16 and float32."""
    if not accelerator:
        figures = platforms.matmul_probe(rows=2048, repeats=15)
        return max((rate, dtype) for dtype, rate in figures.items()) + (figures,)
    m = k = n = 8192
    f = jax.jit(lambda x, w: jnp.einsum("mi,io->mo", x, w, preferred_element_type=jnp.float32))
    x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
    rate = 2 * m * k * n / np.median(timed_runs(lambda: f(x, w).block_until_ready(), 20, warmup=3)) / 1e9
    return rate, "bfloat16", {"bfloat16": rate}


def sequence_flops(cfg, tokens: int, start: int = 0) -> float:
    """Forward FLOPs of `tokens` tokens at positions start.. (causal attention), plus one vocabulary row."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (tokens * start + tokens * (tokens + 1) / 2)
    return tokens * 2.0 * cfg.non_embedding_params() + attention + 2.0 * cfg.hidden_size * cfg.vocab_size


def request_flops(cfg, sequences: list[list[int]]) -> float:
    """FLOPs the math needs: a shared prefix counts once (as scorefn computes it), so MFU is not flattered."""
    shared = shareable_prefix(Job(sequences, ()))
    return sequence_flops(cfg, shared) + sum(sequence_flops(cfg, len(s) - shared, shared) for s in sequences)


async def _http_clients(url: str, clients: int, seconds: float, body: dict) -> tuple[list[float], float]:
    """Latencies of the requests `clients` closed-loop clients send for `seconds`, and the wall time until the last
    answer (requests in flight at the deadline finish: counting them against `seconds` alone would overstate)."""
    latencies: list[float] = []
    started_at = time.perf_counter()
    stop_at = started_at + seconds

    async def client(http):
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            response = await http.post(url + "/v1/score", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies, time.perf_counter() - started_at


def _engine_counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + " ", name + "_total ")):  # counters carry the _total suffix
            return float(line.split()[1])
    return 0.0


W3_BODY = {"query": "Review: the room was clean and close to the station. Sentiment:",
           "items": [" The friendly staff greeted us at the door."], "label_token_ids": [2731, 3524]}
W3_TRACED_ROUNDS = 3  # alternations of the concurrent load, tracing off then on


def run_w3(seconds: float, clients: int, env: dict[str, str]) -> dict:
    """One client at a time, then `clients` at once; then the concurrent load with tracing on (every request's spans
    exported over OTLP/HTTP to a receiver in this process) against the same load with it off, in alternation
    (`traced_vs_off`; the spread of the runs with it off is the noise)."""
    # W3 measures how far batching across requests goes, not admission: the queue may wait as long as it takes.
    env = {**env, "SCOREFN_MAX_WAIT_S": "600"}
    with ServerProcess(env=env) as server, OtlpReceiver(decode=False) as receiver, ServerProcess(env={
            **env, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_SAMPLER": "always_on"}) as traced:
        for each in (server, traced):
            asyncio.run(_http_clients(each.url, 1, 1.0, W3_BODY))  # connection set-up, first requests
        result = {name: _w3_load(server.url, n, seconds) for name, n in (("serial", 1), ("concurrent", clients))}
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(W3_TRACED_ROUNDS):
            for name, each in (("off", server), ("on", traced)):
                runs[name].append(_w3_load(each.url, clients, seconds / W3_TRACED_ROUNDS))
    rates = {name: [run["items_per_s"] for run in rows] for name, rows in runs.items()}
    result["traced"] = {"items_per_s_off": rates["off"], "items_per_s_on": rates["on"],
                        "traced_vs_off": float(np.median(rates["on"]) / np.median(rates["off"])),
                        "off_spread": max(rates["off"]) / min(rates["off"]) - 1, "exports": receiver.exports,
                        "exported_bytes": receiver.bytes}
    return result


def _w3_load(url: str, clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients for `seconds`: items/s, latency percentiles, the mean device batch."""
    batches = _engine_counter(url, "scorefn_engine_device_batches")
    rows = _engine_counter(url, "scorefn_engine_device_batch_sequences")
    latencies, elapsed = asyncio.run(_http_clients(url, clients, seconds, W3_BODY))
    batches = _engine_counter(url, "scorefn_engine_device_batches") - batches
    rows = _engine_counter(url, "scorefn_engine_device_batch_sequences") - rows
    return {**summarize(latencies, 1), "items_per_s": len(latencies) / elapsed,
            "mean_device_batch": rows / batches if batches else 0.0}


def run_w4(scorer, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Per-token log-probabilities with the top alternatives of every position (an evaluation harness's load)."""
    prompts, tokens, top_k = (4, 32, W4_SIZE[2]) if smoke else W4_SIZE
    sequences = w4_prompts(vocab, prompts, tokens)
    runs = 2 if quick else 5
    entry = {"prompts": prompts, "tokens": tokens,
             "scorefn": summarize(timed_runs(lambda: scorer.token_logprobs(sequences), runs), prompts)}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.token_logprobs(sequences),
                                                          runs)
    for dt, torch_scorer in baselines.items():
        entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.token_logprobs(sequences, top_k),
                                                    max(1, runs // 2)), prompts)
    for row in entry.values():
        if isinstance(row, dict):
            row["tokens_per_s"] = row["items_per_s"] * tokens
    return entry


def run_w5(scorer, settings, loaded, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Reranking: pairs that share the template head and the query, scored with and without prefix sharing."""
    sizes = (27, 16, 4, 16, 8) if smoke else W5_SIZE
    documents = sizes[2]
    prefix, rests, labels = w5_request(vocab, *sizes)
    sequences = [prefix + rest for rest in rests]
    unshared, _ = startup.scorer(settings.replace(prefix_sharing=False), loaded, lazy=True)
    runs = 2 if quick else 5
    entry = {"documents": documents, "scorefn": summarize(timed_runs(lambda: scorer.score(sequences, labels), runs),
                                                          documents),
             "scorefn_no_sharing": summarize(timed_runs(lambda: unshared.score(sequences, labels), runs), documents)}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.score(sequences, labels), runs)
    for dt, torch_scorer in baselines.items():
        entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_full(sequences, labels),
                                                    max(1, runs // 2)), documents)
        entry[f"torch_{dt}_prefix_cache"] = summarize(timed_runs(
            lambda: torch_scorer.score_prefix_cached(prefix, rests, labels), max(1, runs // 2)), documents)
    return entry


def run_w6(scorer, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Multiple choice at scale: labels of several tokens after each query + item, scored as label rows (the query
    computed once, each item's rows after it) against transformers scoring every (prompt, label) sequence in full,
    and against it with each prompt's KV cache reused for its labels."""
    query_tokens, n_items, item_tokens, label_tokens = (40, 4, 8, (2, 3)) if smoke else W6_SIZE
    query, items, labels = w6_request(vocab, query_tokens, n_items, item_tokens, label_tokens)
    prompts = [query + item for item in items]
    runs = 2 if quick else 5

    def ours(s):
        return label_scores(s.score_jobs([label_rows(prompts, labels)])[0], labels)[0]
    entry = {"items": n_items, "labels": len(labels),
             "scorefn": summarize(timed_runs(lambda: ours(scorer), runs), n_items)}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, ours, runs)
    subset = n_items if smoke else 10  # the full-sequence baseline is linear in items: timed on a subset
    for dt, torch_scorer in baselines.items():
        entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_labels_full(prompts[:subset], labels),
                                                    1, warmup=0), subset)
        entry[f"torch_{dt}_prompt_cache"] = summarize(timed_runs(
            lambda: torch_scorer.score_labels_prompt_cached(prompts, labels), max(1, runs // 2)), n_items)
    return entry


def run_lora(settings, loaded, scorer, vocab: int, smoke: bool, quick: bool) -> dict:
    """LoRA adapters mixed in one device round against the base model on the same requests (runtime.model.lora):
    the adapters' cost in the programs (every projection's update for every slot at once)."""
    adapters, rank, requests = (2, 4, 2) if smoke else LORA_SIZE
    items = 16 if smoke else W1_SIZES[-1]
    cfg = loaded.cfg
    shapes = lora.projection_shapes(cfg)
    adapted, _ = compose(settings.replace(max_loras=adapters, max_lora_rank=rank), cfg, loaded.arrays, lazy=True,
                         quiet=True, adapters=random_adapters(shapes, cfg.num_layers, adapters, rank))
    sequences, labels = w1_request(vocab, items)
    base_jobs = [Job(sequences[r::requests], labels) for r in range(requests)]
    mixed_jobs = [Job(job.sequences, labels, adapter=r % adapters + 1) for r, job in enumerate(base_jobs)]
    query_tokens, n_items, item_tokens = (200, 10, 20) if smoke else W2_SIZES["w2"]
    query, rest = w2_request(vocab, query_tokens, n_items, item_tokens)
    w2 = [query + item for item in rest]
    runs = 2 if quick else 5
    entry = {"adapters": adapters, "rank": rank, "items": items, "requests": requests,
             "w1_base": summarize(timed_runs(lambda: scorer.score_jobs(base_jobs), runs), items),
             "w1_mixed": summarize(timed_runs(lambda: adapted.score_jobs(mixed_jobs), runs), items),
             "w2_base": summarize(timed_runs(lambda: scorer.score_jobs([Job(w2, [FIRST_ID])]), runs), n_items),
             "w2_adapter": summarize(timed_runs(lambda: adapted.score_jobs([Job(w2, [FIRST_ID], adapter=1)]), runs),
                                     n_items)}
    entry["w1_ratio"] = entry["w1_mixed"]["items_per_s"] / entry["w1_base"]["items_per_s"]
    entry["w2_ratio"] = entry["w2_adapter"]["items_per_s"] / entry["w2_base"]["items_per_s"]
    return entry


def run_batch(vocab: int, items: int, lines: int, env: dict[str, str]) -> dict:
    """W1 requests of `items` items as a batch file of `lines` lines through `scorefn batch` in process: the
    job's own items/s (from its summary: the engine's start is not counted)."""
    with tempfile.TemporaryDirectory(prefix="scorefn-bench-batch-") as tmp:
        source, output = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        source.write_text(w1_batch_file(vocab, items, lines))
        done = subprocess.run(scorefn_command("batch", str(source), str(output), "--progress", "log",
                                              "--progress-interval", "3600"),
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"scorefn batch failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"lines": lines, "items": summary["items"], "errors": summary["errors"],
            "items_per_s": summary["items_per_s"], "elapsed_s": summary["elapsed_s"]}


def compile_times(model_dir: Path) -> dict:
    """The default bucket set's warm-up in a fresh process: into an empty persistent cache, then from it."""
    with tempfile.TemporaryDirectory(prefix="scorefn-bench-xla-") as cache:
        runs = {}
        for name in ("cold", "cached"):
            done = subprocess.run([sys.executable, "-m", "runtime.tools.bench", "--compile-only", str(model_dir)],
                                  env={**os.environ, "SCOREFN_COMPILE_CACHE_DIR": cache}, capture_output=True,
                                  text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"compile run failed:\n{done.stderr[-3000:]}")
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return runs


def compile_only(model_dir: str) -> int:
    """`python -m runtime.tools.bench --compile-only DIR`: load, compile every default bucket, print the timings."""
    settings = load_settings()
    enable_persistent_cache(settings.xla_cache_dir)
    started = time.perf_counter()
    loaded = load_model(model_dir, settings.cache_dir)
    scorer, platform = startup.scorer(settings, loaded)
    loaded_s = time.perf_counter() - started
    compiled = time.perf_counter()
    buckets = scorer.exe.warm_up(scorer.plan.programs(scorer.task))
    events = cache_events()
    print(json.dumps({"buckets": buckets, "load_s": loaded_s, "compile_s": time.perf_counter() - compiled,
                      "cache_hits": events["hits"], "cache_misses": events["misses"],
                      "platform": platform.describe()}))
    return 0


def run_roofline(args: argparse.Namespace) -> int:
    """`scorefn bench --roofline TARGET`: no device needed. The real planner's device batches for every workload
    in the grid and the packed layout, their padded tokens, and the device time they need at the target's peak
    compute and bandwidth (upper bounds on items/s; runtime.tools.roofline)."""
    config = Path(args.model_config or QWEN3_CONFIG)
    cfg = load_config(config.parent) if config.name == "config.json" else _config_file(config)
    settings = load_settings()
    report = {"model": f"{cfg.architecture} {cfg.num_layers}L d{cfg.hidden_size} ({config.name})",
              "padding": padding_report(settings, cfg, "gpu"), "roofline": roofline_report(settings, cfg, args.roofline)}
    print(f"model: {report['model']}; target {args.roofline}; upper bounds ({report['roofline']['method']})")
    for layout, entry in report["padding"].items():
        print(f"{layout:6}: {entry['executables']} executables")
        for name, row in entry["workloads"].items():
            bound = report["roofline"]["layouts"][layout][name]
            rate = next(v for k, v in bound.items() if k.endswith("_upper_bound"))
            print(f"  {name:8} {row['device_batches']:3} device batches, padded tokens {row['overhead']:.3f}x, "
                  f"{bound['seconds'] * 1e3:9.3f} ms at peak, <= {rate:,.0f} /s", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0


def _config_file(path: Path):
    return config_from_hf(json.loads(path.read_text()))


# ---- main ----------------------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    if getattr(args, "roofline", None):
        return run_roofline(args)
    # PyTorch's baselines share the GPU: JAX takes memory as it needs it instead of 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    settings = load_settings()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per W3 request otherwise
    smoke = getattr(args, "smoke", False)  # the test suite's run: every code path, minimal sizes
    quick = args.quick or smoke
    repeats = 2 if smoke else 5 if quick else 20
    backend = platforms.current_backend()
    accelerator = backend != "cpu"
    tmp = tempfile.TemporaryDirectory(prefix="scorefn-bench-")
    config = args.model_config or (str(QWEN3_CONFIG) if accelerator else None)
    if config:
        model_dir = random_checkpoint(config, Path(tmp.name))
    else:
        model_dir, _ = resolve_model_dir(settings.model, settings.cache_dir)  # SCOREFN_MODEL, else the embedded one
    loaded = load_model(str(model_dir), settings.cache_dir)
    scorer, platform = startup.scorer(settings, loaded, lazy=True)
    # The same settings with batch invariance the other way: its cost per workload, measured beside scorefn's own.
    other = "false" if platform.kernels.batch_invariant else "true"
    flipped, _ = startup.scorer(settings.replace(batch_invariant=other), loaded, lazy=True)
    invariant_and_not = (scorer, flipped) if platform.kernels.batch_invariant else (flipped, scorer)
    cfg, vocab = loaded.cfg, loaded.cfg.vocab_size
    peak, peak_dtype, rates = matmul_peak(accelerator)
    cpu = platforms.host_cpu()  # every figure says which host it comes from
    report: dict = {"backend": backend, "platform": platform.describe(), "cpus": os.cpu_count(),
                    "cpu": cpu.describe(),
                    "model": f"{cfg.architecture} {cfg.num_layers}L d{cfg.hidden_size}"
                             + (" (random weights)" if config else f" ({loaded.model_id})"),
                    "matmul_peak_gflops": peak, "matmul_peak_dtype": peak_dtype, "matmul_gflops": rates}
    shown = ", ".join(f"{dtype} {rate:.0f}" for dtype, rate in rates.items())
    print(f"model: {report['model']}; platform {report['platform']}; matmul GFLOP/s {shown}; "
          f"host {cpu.describe()}, {os.cpu_count()} cores", flush=True)

    baselines = {}
    if not args.skip_torch:
        # On a CPU without bfloat16 instructions PyTorch's bfloat16 runs ~5x slower than float32: not what a user
        # would run there, so only float32.
        bf16 = cpu.feature_class in platforms.BF16_MATMUL_CLASSES
        dtypes = ("bfloat16",) if accelerator else ("bfloat16", "float32") if bf16 else ("float32",)
        baselines = {dt: TorchScorer(model_dir, dt, pad_id=0) for dt in dtypes}

    def ours(sequences, labels, runs):
        row = summarize(timed_runs(lambda: scorer.score(sequences, labels), runs), len(sequences))
        row["gflops"] = request_flops(cfg, sequences) * row["items_per_s"] / len(sequences) / 1e9
        row["mfu"] = row["gflops"] / peak
        row["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.score(sequences, labels), runs)
        return row

    report["w1"] = {}
    for n in (W1_SIZES[:2] if smoke else W1_SIZES):
        sequences, labels = w1_request(vocab, n)
        entry = {"scorefn": ours(sequences, labels, repeats)}
        line = f"W1 {n:>3} items: scorefn {entry['scorefn']['items_per_s']:9.1f} items/s " \
               f"p50 {entry['scorefn']['p50_ms']:7.2f} ms (invariance {entry['scorefn']['invariance_cost']:.2f}x)"
        for dt, torch_scorer in baselines.items():
            entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_full(sequences, labels),
                                                        max(2, repeats // 4)), n)
            line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:8.1f} items/s"
        report["w1"][n] = entry
        print(line, flush=True)

    w2_names = ["w2"] + (["w2_peer"] if (accelerator or args.peer) and not smoke else [])
    for name in w2_names:
        query_tokens, n_items, item_tokens = (200, 10, 20) if smoke else W2_SIZES[name]
        query, items = w2_request(vocab, query_tokens, n_items, item_tokens)
        sequences, labels = [query + item for item in items], [FIRST_ID]
        entry = {"query_tokens": query_tokens, "items": n_items, "scorefn": ours(sequences, labels,
                                                                                   2 if quick else 5)}
        line = f"W2 {query_tokens}x{n_items}x{item_tokens}: scorefn {entry['scorefn']['items_per_s']:.1f} items/s " \
               f"(MFU {entry['scorefn']['mfu']:.3f}, invariance {entry['scorefn']['invariance_cost']:.2f}x)"
        # On a CPU the full-sequence baseline is timed on a subset: its cost is linear in items (no sharing).
        subset = n_items if accelerator else 2 if smoke else 8 if quick else 20
        for dt, torch_scorer in baselines.items():
            entry[f"torch_{dt}"] = summarize(timed_runs(
                lambda: torch_scorer.score_full(sequences[:subset], labels), 1 if not accelerator else 3,
                warmup=0 if not accelerator else 1), subset)
            entry[f"torch_{dt}_prefix_cache"] = summarize(timed_runs(
                lambda: torch_scorer.score_prefix_cached(query, items, labels), 1 if not accelerator else 3), n_items)
            line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:.2f}, prefix cache " \
                    f"{entry[f'torch_{dt}_prefix_cache']['items_per_s']:.1f} items/s"
        report[name] = entry
        print(line, flush=True)

    report["w4"] = run_w4(scorer, baselines, vocab, smoke, quick, invariant_and_not)
    w4 = report["w4"]
    line = f"W4 {w4['prompts']}x{w4['tokens']} echo+logprobs {W4_SIZE[2]}: scorefn " \
           f"{w4['scorefn']['items_per_s']:.1f} prompts/s ({w4['scorefn']['tokens_per_s']:.0f} tokens/s, invariance " \
           f"{w4['scorefn']['invariance_cost']:.2f}x)"
    for dt in baselines:
        line += f" | torch {dt} {w4[f'torch_{dt}']['items_per_s']:.2f} prompts/s"
    print(line, flush=True)

    report["lora"] = run_lora(settings, loaded, scorer, vocab, smoke, quick)
    lo = report["lora"]
    print(f"LoRA {lo['adapters']} adapters of rank {lo['rank']}: W1 {lo['items']} items as {lo['requests']} requests, "
          f"one adapter each: {lo['w1_mixed']['items_per_s']:.1f} items/s against the base model's "
          f"{lo['w1_base']['items_per_s']:.1f} ({lo['w1_ratio']:.2f}x); W2 with one adapter "
          f"{lo['w2_adapter']['items_per_s']:.1f} against {lo['w2_base']['items_per_s']:.1f} ({lo['w2_ratio']:.2f}x)",
          flush=True)

    report["w5"] = run_w5(scorer, settings, loaded, baselines, vocab, smoke, quick, invariant_and_not)
    w5 = report["w5"]
    line = f"W5 rerank {w5['documents']} documents: scorefn {w5['scorefn']['items_per_s']:.1f} documents/s, " \
           f"prefix sharing off {w5['scorefn_no_sharing']['items_per_s']:.1f}, invariance " \
           f"{w5['scorefn']['invariance_cost']:.2f}x"
    for dt in baselines:
        line += f" | torch {dt} {w5[f'torch_{dt}']['items_per_s']:.2f}, prefix cache " \
                f"{w5[f'torch_{dt}_prefix_cache']['items_per_s']:.1f} documents/s"
    print(line, flush=True)

    report["w6"] = run_w6(scorer, baselines, vocab, smoke, quick, invariant_and_not)
    w6 = report["w6"]
    line = f"W6 multiple choice {w6['items']} items x {w6['labels']} labels: scorefn " \
           f"{w6['scorefn']['items_per_s']:.1f} items/s (invariance {w6['scorefn']['invariance_cost']:.2f}x)"
    for dt in baselines:
        line += f" | torch {dt} {w6[f'torch_{dt}']['items_per_s']:.2f}, prompt cache " \
                f"{w6[f'torch_{dt}_prompt_cache']['items_per_s']:.1f} items/s"
    print(line, flush=True)

    if not config:  # the embedded model (or SCOREFN_MODEL): what `scorefn batch` loads by itself
        batch_items = W1_SIZES[1] if smoke else W1_SIZES[-1]
        report["batch"] = run_batch(vocab, batch_items, 2 if smoke else BATCH_LINES,
                                    {**SMALL_BUCKETS, "SCOREFN_DTYPE": platform.dtype} if smoke else {})
        report["batch"]["vs_w1"] = report["batch"]["items_per_s"] / report["w1"][batch_items]["scorefn"]["items_per_s"]
        ba = report["batch"]
        print(f"Batch file of {ba['lines']} W1-{batch_items} lines in process: {ba['items_per_s']:.1f} items/s "
              f"({ba['vs_w1']:.2f}x W1-{batch_items}'s {report['w1'][batch_items]['scorefn']['items_per_s']:.1f})",
              flush=True)

    if not args.skip_http and not config:
        env = {"SCOREFN_LENGTH_BUCKETS": "32,64", "SCOREFN_BATCH_BUCKETS": "1,2,4,8,16,32",
               "SCOREFN_SUFFIX_LENGTH_BUCKETS": "16", "SCOREFN_SUFFIX_BATCH_BUCKETS": "8",
               "SCOREFN_MAX_LABELS": "16", "SCOREFN_DTYPE": platform.dtype}
        report["w3"] = run_w3(1.0 if smoke else 4.0 if quick else 15.0, 32, env)
        for name in ("serial", "concurrent"):
            row = report["w3"][name]
            print(f"W3 {name:10}: {row['items_per_s']:7.1f} items/s p50 {row['p50_ms']:7.1f} ms "
                  f"p99 {row['p99_ms']:7.1f} ms mean device batch {row['mean_device_batch']:.1f}", flush=True)
        traced = report["w3"]["traced"]
        print(f"W3 traced    : {traced['traced_vs_off']:.3f}x the items/s with tracing off (medians of "
              f"{W3_TRACED_ROUNDS} alternating runs; off runs spread {traced['off_spread']:.1%}; "
              f"{traced['exported_bytes'] / 1e6:.1f} MB of spans exported)", flush=True)

    if args.compile_times:
        report["compile"] = compile_times(Path(model_dir))
        for name, row in report["compile"].items():
            print(f"compile {name:6}: {row['buckets']} buckets in {row['compile_s']:.1f} s "
                  f"(persistent cache {row['cache_hits']} hits, {row['cache_misses']} misses)", flush=True)

    summary = _summary(report, baselines)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**report, "summary": summary}, indent=2))
    tmp.cleanup()
    print(json.dumps(summary), flush=True)
    return 0


def _summary(report: dict, baselines: dict) -> dict:
    def ratio(entry: dict, other: str):
        theirs = entry.get(other, {}).get("items_per_s", 0)
        return round(entry["scorefn"]["items_per_s"] / theirs, 3) if theirs else None

    summary: dict = {"backend": report["backend"], "single_item_p50_ms": round(report["w1"][1]["scorefn"]["p50_ms"], 3)}
    for n, entry in report["w1"].items():
        summary[f"w1_{n}_items_per_s"] = round(entry["scorefn"]["items_per_s"], 1)
        summary[f"mfu_w1_{n}"] = round(entry["scorefn"]["mfu"], 3)
        for dt in baselines:
            summary[f"w1_{n}_vs_torch_{dt}"] = ratio(entry, f"torch_{dt}")
    for name in ("w2", "w2_peer"):
        if name in report:
            entry = report[name]
            summary[f"{name}_items_per_s"] = round(entry["scorefn"]["items_per_s"], 1)
            summary[f"mfu_{name}"] = round(entry["scorefn"]["mfu"], 3)
            for dt in baselines:
                summary[f"{name}_vs_torch_{dt}"] = ratio(entry, f"torch_{dt}")
                summary[f"{name}_vs_torch_{dt}_prefix_cache"] = ratio(entry, f"torch_{dt}_prefix_cache")
    for name in ("w4", "w5", "w6"):
        entry = report[name]
        summary[f"{name}_items_per_s"] = round(entry["scorefn"]["items_per_s"], 1)
        for dt in baselines:
            summary[f"{name}_vs_torch_{dt}"] = ratio(entry, f"torch_{dt}")
    summary["w4_tokens_per_s"] = round(report["w4"]["scorefn"]["tokens_per_s"])
    # LoRA adapters mixed in a round, against the base model on the same requests (the aim: at least 0.8).
    summary["lora_w1_vs_base"] = round(report["lora"]["w1_ratio"], 3)
    summary["lora_w2_vs_base"] = round(report["lora"]["w2_ratio"], 3)
    if "batch" in report:  # `scorefn batch` in process against the same requests through the scorer (the aim: 0.9)
        summary["batch_vs_w1"] = round(report["batch"]["vs_w1"], 3)
    # Time with the batch-invariant kernels over without, per workload (the aim: at most 1.1 on a CPU).
    costs = {f"w1_{n}": entry["scorefn"]["invariance_cost"] for n, entry in report["w1"].items()}
    costs |= {name: report[name]["scorefn"]["invariance_cost"]
              for name in ("w2", "w2_peer", "w4", "w5", "w6") if name in report}
    summary["invariance_cost"] = costs
    summary["w5_sharing_vs_not"] = ratio(report["w5"], "scorefn_no_sharing")
    for dt in baselines:
        summary[f"w5_vs_torch_{dt}_prefix_cache"] = ratio(report["w5"], f"torch_{dt}_prefix_cache")
        summary[f"w6_vs_torch_{dt}_prompt_cache"] = ratio(report["w6"], f"torch_{dt}_prompt_cache")
    if "w3" in report:
        w3 = report["w3"]
        summary["w3_concurrent_vs_serial"] = round(w3["concurrent"]["items_per_s"] / w3["serial"]["items_per_s"], 3)
        summary["w3_traced_vs_off"] = round(w3["traced"]["traced_vs_off"], 3)
    if "compile" in report:
        summary["compile_cold_s"] = round(report["compile"]["cold"]["compile_s"], 1)
        summary["compile_cached_s"] = round(report["compile"]["cached"]["compile_s"], 1)
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--compile-only":
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        sys.exit(compile_only(sys.argv[2]))
    sys.exit("usage: python -m runtime.tools.bench --compile-only MODEL_DIR (the benchmark itself: scorefn bench)")
