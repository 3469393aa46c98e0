"""What every workload of the benchmark measures with: timed runs, the batch-invariant kernels' cost, latency
summaries, the device's matmul peak (MFU's denominator) and the FLOPs a request's math needs (its numerator)."""

from __future__ import annotations

import time

import numpy as np

import jax
import jax.numpy as jnp

from runtime.assembly import platform as platforms
from runtime.requests.jobs import Job, shareable_prefix


def timed_runs(fn, repeats: int, warmup: int = 1, min_seconds: float = 0.0) -> list[float]:
    """The times of `repeats` runs of fn after `warmup`, and more until they add up to `min_seconds` (at most 100
    runs): a 50 ms request timed 5 times was decided by one slow run (W1 at one item, mean 65 ms against p50 51)."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    while len(out) < repeats or (sum(out) < min_seconds and len(out) < 100):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def alternating_runs(fns: dict, runs: dict, warmup: int = 1) -> dict[str, list[float]]:
    """The times of each of `fns` (name -> fn), run in turns after `warmup` runs each, runs[name] of each (a slow
    baseline fewer): a slow spell of the host (1.4-1.7x for a minute on a 2-core cloud VM) then falls on both sides
    of a ratio, where timing one side after the other let it decide the ratio (W4 read 1.29x and 1.56x
    transformers in two runs of the same code)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for turn in range(max(runs.values())):
        for name, fn in fns.items():
            if turn < runs[name]:
                started = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - started)
    return out


def invariance_cost(scorers, run, runs: int) -> float:
    """Median time of `run(scorer)` with the batch-invariant kernels over without (scorers: (invariant, not)),
    alternating runs in this process (after one that compiles each's buckets) so that both see the same machine."""
    invariant, not_invariant = scorers
    times = alternating_runs({"invariant": lambda: run(invariant), "not": lambda: run(not_invariant)},
                             {"invariant": runs, "not": runs})
    return round(float(np.median(times["invariant"]) / np.median(times["not"])), 3)


def summarize(latencies: list[float], items: int) -> dict:
    lat = np.asarray(latencies)
    return {"items_per_s": items * len(lat) / lat.sum(), "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def torch_pairs(entry: dict, baselines, cached: str, cached_name: str, unit: str) -> str:
    """The summary line's tail for workloads timed against two transformers scripts per dtype, in full and with a
    cache (`entry["torch_<dtype>"]` and `entry["torch_<dtype>_<cached>"]`): W5's prefix cache, W6's prompt cache."""
    return "".join(f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:.2f}, {cached_name} "
                   f"{entry[f'torch_{dt}_{cached}']['items_per_s']:.1f} {unit}" for dt in baselines)


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
