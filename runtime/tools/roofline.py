"""What the benchmark's workloads cost on a device that is not here: the real bucket planner's device batches,
their padded tokens, and (`scorefn bench --roofline TARGET`) the device time they need at the target's peak.

The planner runs for real (runtime.requests.scorer.Scorer.dispatch) with a recorder in place of the executables,
so the device batches are exactly the ones a server would dispatch. For each workload:
- padding: tokens computed / tokens the math needs (a shared prefix once), for the grid and the packed layout;
- roofline: per device batch, max(FLOPs / peak, bytes / bandwidth), summed, and the items/s that bounds. TPU:
  FLOPs and bytes from XLA's cost analysis of the deviceless-compiled programs, with the scanned layer body
  counted per layer (each program compiled with 1 and 2 layers: body = f(2) - f(1), total = f(1) + (L-1) body);
  GPU: the model's FLOPs and bytes (weights once per device batch, the context's keys and values, activations).
  LoRA adapter slots (SCOREFN_MAX_LORAS, SCOREFN_MAX_LORA_RANK) count in both: TPU programs are compiled with them,
  the GPU's FLOPs add every slot's updates.
  Upper bounds on items/s: real devices reach a fraction of peak.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from runtime.model import lora
from runtime.model.transformer import rope_length_limit
from runtime.assembly import platform as platforms
from runtime.assembly.compose import bucket_plan, compose
from runtime.requests.jobs import Job, shareable_prefix
from runtime.shapes.programs import PROGRAMS
from runtime.requests.scorer import Scorer
from runtime.assembly.targets import parse_target
from runtime.tools.workloads import workloads


class Recorder:
    """Stands in for runtime.assembly.executables.Executables: notes every (program, bucket) dispatched."""

    compile_only = True
    store = None

    def __init__(self, model: Any):
        self.model = model  # what the scorer reads of it: the config and the RoPE limit
        self.calls: list[tuple[str, tuple]] = []

    def __call__(self, method: str, key: tuple, *args: Any):
        self.calls.append((method, key))
        # What the scorer unpacks: a context's keys and values, a forward pass's pooled rows and label tails.
        return (None, None) if PROGRAMS[method].kind in ("context", "full", "continuation") else None


def needed_tokens(jobs: list) -> int:
    """Tokens the math needs: each request's shared prefix once (as prefix sharing computes it), then the rest."""
    total = 0
    for job in jobs:
        lengths = [len(s) for s in job.sequences]
        shared = shareable_prefix(job) if isinstance(job, Job) else 0
        total += shared + sum(n - shared for n in lengths)
    return total


def plan_calls(settings, cfg, backend: str, jobs: list):
    """(plan, the (program, bucket) calls the real planner makes for `jobs` on `backend`'s platform)."""
    platform = platforms.resolve(settings, backend)
    plan = bucket_plan(settings, platform)
    recorder = Recorder(types.SimpleNamespace(cfg=cfg, rope_length_limit=rope_length_limit(cfg, plan.max_length)))
    Scorer(plan, recorder).dispatch(jobs)
    return plan, recorder.calls


def padding_report(settings, cfg, backend: str) -> dict:
    """Per layout (grid, packed): executables compiled, and per workload device batches and padded-token ratio."""
    report: dict = {}
    for layout in ("grid", "packed"):
        laid = settings.replace(bucket_layout=layout)
        entry: dict = {}
        for name, (jobs, _) in workloads(cfg.vocab_size).items():
            plan, calls = plan_calls(laid, cfg, backend, jobs)
            computed = sum(PROGRAMS[method].tokens(key) for method, key in calls)
            entry[name] = {"device_batches": sum(1 for method, _ in calls if PROGRAMS[method].kind != "head"),
                           "tokens_computed": computed, "tokens_needed": needed_tokens(jobs),
                           "overhead": round(computed / needed_tokens(jobs), 3)}
        report[layout] = {"executables": plan.count(cfg.task), "workloads": entry}
    return report


# ---- roofline ------------------------------------------------------------------------------------------------

def tpu_costs(settings, cfg, target, calls: set) -> dict[tuple, tuple[float, float]]:
    """(FLOPs, bytes accessed) per (entry point, bucket) from cost analysis of deviceless TPU programs, with the
    scanned layer body counted once per layer (compiled at 1 and 2 layers, extrapolated to the model's depth)."""
    by_depth = {}
    for depth in (1, 2):
        scorer, _ = compose(settings, dataclasses.replace(cfg, num_layers=depth), None, devices=target.devices(),
                            probe=False)
        for method, key in calls:
            specs = scorer.exe.specs(PROGRAMS[method], key)
            cost = scorer.exe.lower(method, *specs).compile().cost_analysis()
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
    target = parse_target(target_name)
    chip = target.chip
    peak, bandwidth = chip.peak_bf16_flops * target.device_count, chip.memory_bandwidth * target.device_count
    weight_bytes = 2 * cfg.non_embedding_params()  # bfloat16 layers
    lora_columns = lora.slots(settings.lora_adapters, settings.max_loras) * settings.max_lora_rank
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
                    PROGRAMS[method].cost(key, cfg, weight_bytes, lora_columns)
                flops, traffic = flops + f, traffic + b
                seconds += max(f / peak, b / bandwidth)
            rows[name] = {"device_batches": len(calls), "flops": flops, "bytes": traffic,
                          "seconds": seconds, f"{unit}_per_s_upper_bound": round(items / seconds, 1)}
        report["layouts"][layout] = rows
    return report
