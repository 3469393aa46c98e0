"""What the benchmark's workloads cost on a device that is not here: the real bucket planner's device batches,
their padded tokens, and (`scorefn bench --roofline TARGET`) the device time they need at the target's peak.

The planner runs for real (runtime.serving.scorer.Scorer.dispatch) with a recorder in place of the executables,
so the device batches are exactly the ones a server would dispatch. For each workload:
- padding: tokens computed / tokens the math needs (a shared prefix once), for the grid and the packed layout;
- roofline: per device batch, max(FLOPs / peak, bytes / bandwidth), summed, and the items/s that bounds. TPU:
  FLOPs and bytes from XLA's cost analysis of the deviceless-compiled programs, with the scanned layer body
  counted per layer (each program compiled with 1 and 2 layers: body = f(2) - f(1), total = f(1) + (L-1) body);
  GPU: the model's FLOPs and bytes (weights once per device batch, the context's keys and values, activations).
  Upper bounds on items/s: real devices reach a fraction of peak.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np

from runtime.interface import Sampling


HEADS = ("label_logprobs", "class_logits")  # read pooled rows: not a forward pass of their own


class Recorder:
    """Stands in for runtime.serving.executables.Executables: notes every (entry point, bucket) dispatched."""

    compile_only = True
    store = None

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def __call__(self, method: str, key: tuple, *args: Any):
        self.calls.append((method, key))
        return (None, None) if method == "prefill_context" else None


def workloads(vocab: int) -> dict[str, tuple[list, str]]:
    """name -> (jobs, unit): the benchmark's workloads (runtime.tools.bench), at their full sizes."""
    from runtime.serving.jobs import Job, TokenJob
    from runtime.tools import bench

    out: dict[str, tuple[list, str]] = {}
    for n in bench.W1_SIZES:
        sequences, labels = bench.w1_request(vocab, n)
        out[f"w1_{n}"] = ([Job(sequences, labels)], "items")
    for name, (query_tokens, items, item_tokens) in bench.W2_SIZES.items():
        query, rests = bench.w2_request(vocab, query_tokens, items, item_tokens)
        out[name] = ([Job([query + rest for rest in rests], [bench.FIRST_ID])], "items")
    prompts, tokens, _ = bench.W4_SIZE
    rng = np.random.default_rng(4)
    sequences = [bench.token_ids(rng, vocab, tokens) for _ in range(prompts)]
    out["w4"] = ([TokenJob(sequences, [Sampling()] * prompts)], "prompts")
    head, query, documents, document_tokens, tail = bench.W5_SIZE
    rng = np.random.default_rng(5)
    prefix, end = bench.token_ids(rng, vocab, head + query), bench.token_ids(rng, vocab, tail)
    out["w5"] = ([Job([prefix + bench.token_ids(rng, vocab, document_tokens) + end for _ in range(documents)],
                      bench.token_ids(rng, vocab, 2))], "documents")
    return out


def needed_tokens(jobs: list) -> int:
    """Tokens the math needs: each request's shared prefix once (as prefix sharing computes it), then the rest."""
    from runtime.serving.jobs import Job, common_prefix_length

    total = 0
    for job in jobs:
        lengths = [len(s) for s in job.sequences]
        shared = min(common_prefix_length(job.sequences), min(lengths) - 1) \
            if isinstance(job, Job) and len(lengths) > 1 else 0
        total += shared + sum(n - shared for n in lengths)
    return total


def call_tokens(plan, method: str, key: tuple) -> int:
    """Token positions one device batch computes (padding included); heads compute none."""
    if method in ("hidden", "token_logprobs", "hidden_packed"):
        return key[0] * key[1]
    if method == "prefill_context":
        return key[0]
    if method in ("hidden_after_context", "hidden_packed_after_context"):
        return key[1] * key[2]
    return 0


def plan_calls(settings, cfg, backend: str, jobs: list):
    """(plan, the (entry point, bucket) calls the real planner makes for `jobs` on `backend`'s platform)."""
    from runtime.model.transformer import rope_length_limit
    from runtime.serving import platform as platforms
    from runtime.serving.compose import bucket_plan
    from runtime.serving.scorer import Scorer

    platform = platforms.resolve(settings, backend)
    plan = bucket_plan(settings, platform)
    recorder = Recorder()
    stub = types.SimpleNamespace(cfg=cfg, attention_dtype=np.float32,
                                 rope_length_limit=rope_length_limit(cfg, plan.max_length))
    Scorer(stub, plan, executables=recorder).dispatch(jobs)
    return plan, recorder.calls


def padding_report(settings, cfg, backend: str) -> dict:
    """Per layout (grid, packed): executables compiled, and per workload device batches and padded-token ratio."""
    report: dict = {}
    for layout in ("grid", "packed"):
        laid = settings.replace(bucket_layout=layout)
        entry: dict = {}
        for name, (jobs, _) in workloads(cfg.vocab_size).items():
            plan, calls = plan_calls(laid, cfg, backend, jobs)
            computed = sum(call_tokens(plan, method, key) for method, key in calls)
            entry[name] = {"device_batches": sum(1 for method, _ in calls if method not in HEADS),
                           "tokens_computed": computed, "tokens_needed": needed_tokens(jobs),
                           "overhead": round(computed / needed_tokens(jobs), 3)}
        report[layout] = {"executables": plan.count(), "workloads": entry}
    return report


# ---- roofline ------------------------------------------------------------------------------------------------

def gpu_cost(cfg, plan, method: str, key: tuple, weight_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one device batch from the model's shapes: matmuls and attention as computed (padding
    included); weights read once, the context's keys and values, activations written and read once per matmul."""
    L, H, K, E, D, V = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size
    dense = 2.0 * cfg.non_embedding_params()
    pair = 4.0 * L * H * E  # one query-key pair: scores and weighted values, every layer
    kv_bytes = 2 * L * K * E * 2
    if method in ("label_logprobs", "class_logits"):
        rows = key[0]
        return 2.0 * D * V * rows, V * D * 4 + rows * (D + (key[1] if len(key) > 1 else 1)) * 4
    if method == "prefill_context":
        rows, width, context = 1, key[0], 0
    elif method in ("hidden", "token_logprobs", "hidden_packed"):
        rows, width, context = key[0], key[1], 0
    else:  # hidden_after_context, hidden_packed_after_context: (context, rows, width)
        context, rows, width = key
    tokens = rows * width
    flops = tokens * dense + pair * (rows * width * width / 2 + tokens * context)
    traffic = weight_bytes + context * kv_bytes + tokens * D * 2 * 7 * L * 2  # 7 matmuls, in and out, bfloat16
    if method == "token_logprobs":
        flops += 2.0 * D * V * tokens
        traffic += V * D * 4
    return flops, traffic


def tpu_costs(settings, cfg, target, calls: set) -> dict[tuple, tuple[float, float]]:
    """(FLOPs, bytes accessed) per (entry point, bucket) from cost analysis of deviceless TPU programs, with the
    scanned layer body counted once per layer (compiled at 1 and 2 layers, extrapolated to the model's depth)."""
    from runtime.serving.compose import compose

    by_depth = {}
    for depth in (1, 2):
        scorer, _ = compose(settings, dataclasses.replace(cfg, num_layers=depth), None, devices=target.devices(),
                            probe=False)
        shapes = {(m, k): args for m, k, args in scorer.work()}
        for method, key in calls:
            cost = scorer.exe.lower(method, *shapes[(method, key)]).compile().cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            by_depth[(method, key, depth)] = (cost.get("flops", 0.0), cost.get("bytes accessed", 0.0))
    out = {}
    for method, key in calls:
        (f1, b1), (f2, b2) = by_depth[(method, key, 1)], by_depth[(method, key, 2)]
        L = cfg.num_layers
        out[(method, key)] = (f1 + (L - 1) * (f2 - f1), b1 + (L - 1) * (b2 - b1))
    return out


def roofline_report(settings, cfg, target_name: str) -> dict:
    """Per layout and workload: device seconds at the target's peak and the items/s that bounds (upper bounds)."""
    from runtime.serving.targets import parse_target

    target = parse_target(target_name)
    chip = target.chip
    peak, bandwidth = chip.peak_bf16_flops * target.device_count, chip.memory_bandwidth * target.device_count
    weight_bytes = 2 * cfg.non_embedding_params()  # bfloat16 layers
    report: dict = {"target": target.name, "peak_flops": peak, "bandwidth": bandwidth, "upper_bound": True,
                    "method": "cost analysis, scanned body per layer" if target.backend == "tpu" else
                    "model FLOPs and bytes", "layouts": {}}
    for layout in ("grid", "packed"):
        laid = settings.replace(bucket_layout=layout)
        plans = {name: (plan_calls(laid, cfg, target.backend, jobs), len(jobs[0].sequences), unit)
                 for name, (jobs, unit) in workloads(cfg.vocab_size).items()}
        if target.backend == "tpu":
            distinct = {call for (_, calls), _, _ in plans.values() for call in calls}
            costs = tpu_costs(laid, cfg, target, distinct)
        rows = {}
        for name, ((plan, calls), items, unit) in plans.items():
            seconds = flops = traffic = 0.0
            for method, key in calls:
                f, b = costs[(method, key)] if target.backend == "tpu" else \
                    gpu_cost(cfg, plan, method, key, weight_bytes)
                flops, traffic = flops + f, traffic + b
                seconds += max(f / peak, b / bandwidth)
            rows[name] = {"device_batches": len(calls), "flops": flops, "bytes": traffic,
                          "seconds": seconds, f"{unit}_per_s_upper_bound": round(items / seconds, 1)}
        report["layouts"][layout] = rows
    return report
