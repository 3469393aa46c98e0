"""`scorefn compile --target NAME`: compile every bucket for a target's devices, here and without them (deviceless
ahead-of-time compilation on a CPU host), into the executable store a start on that target reads.

It goes through the serving path's own composition (runtime.assembly.compose) with the target's compile-only
devices, so the platform choices are the target's and the store fingerprint is the one a start on the real device
computes. No weights are read: the model's config.json is enough, and a later start that has the weights loads
the stored executables without compiling. A bucket whose memory exceeds the target device's fails the command,
naming the bucket and the bytes. Whether a deviceless executable loads on the real device is not verified here:
one that does not load is compiled at start (runtime.assembly.store.ExecutableStore.load).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from runtime.model.config import load_config
from runtime.model.loader import resolve_model_dir
from runtime.assembly.compose import compose
from runtime.assembly.store import enable_persistent_cache
from runtime.assembly.targets import TargetError, parse_target
from runtime.settings import load_settings

log = logging.getLogger("scorefn.runtime")

CUDNN_ATTENTION_CALL = "__cudnn$fmha"  # XLA's custom-call target prefix for cuDNN fused attention
# The custom calls of Pallas kernels (the batch-invariant attention): Triton's on a GPU, Mosaic's on a TPU
PALLAS_CALLS = ("__gpu$xla.gpu.triton", 'custom_call_target="tpu_custom_call"')


def model_config_dir(model: str, cache_dir: str) -> Path:
    """The directory holding the served model's config.json: SCOREFN_MODEL (a directory, a config.json, a .gguf
    file) or the embedded model."""
    path = Path(model).expanduser() if model else None
    if path is not None and path.name == "config.json":
        return path.parent
    return resolve_model_dir(model, cache_dir)[0]


def executable_report(method: str, key: tuple, compiled, seconds: float, stored_bytes: int) -> dict:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    return {"method": method, "bucket": list(key), "compile_s": round(seconds, 3),
            "argument_bytes": memory.argument_size_in_bytes if memory else None,
            "output_bytes": memory.output_size_in_bytes if memory else None,
            "temp_bytes": memory.temp_size_in_bytes if memory else None,
            "alias_bytes": memory.alias_size_in_bytes if memory else None,
            "serialized_bytes": stored_bytes,
            "attention": attention_in(compiled.as_text()),
            "flops": cost.get("flops") if cost else None,
            "bytes_accessed": cost.get("bytes accessed") if cost else None}


def attention_in(hlo: str) -> str:
    """cudnn or pallas where the program holds their calls, else xla."""
    return "cudnn" if CUDNN_ATTENTION_CALL in hlo else "pallas" if any(call in hlo for call in PALLAS_CALLS) else "xla"


def device_bytes(row: dict) -> int:
    """What one device holds while the executable runs: arguments (the weights among them), outputs, temporaries."""
    return (row["argument_bytes"] or 0) + (row["output_bytes"] or 0) + (row["temp_bytes"] or 0) \
        - (row["alias_bytes"] or 0)


def memory_problems(rows: list[dict], target) -> list[str]:
    """One message per executable that needs more memory than one device of `target` offers."""
    limit = target.usable_memory()
    if limit is None:
        return []
    return [f"bucket {row['method']}{tuple(row['bucket'])} needs {device_bytes(row) / 1e9:.2f} GB on one "
            f"{target.chip.device_kind} (arguments {(row['argument_bytes'] or 0) / 1e9:.2f}, outputs "
            f"{(row['output_bytes'] or 0) / 1e9:.2f}, temporaries {(row['temp_bytes'] or 0) / 1e9:.2f} GB), more "
            f"than the {limit / 1e9:.2f} GB usable" for row in rows if device_bytes(row) > limit]


def compile_target(target_name: str, settings, json_out: str | None = None) -> dict:
    target = parse_target(target_name)
    # The settings' own compile cache, as a start and `scorefn warmup` use, not one left configured by earlier work
    # in this process.
    enable_persistent_cache(settings.xla_cache_dir)
    cfg = load_config(model_config_dir(settings.model, settings.cache_dir))
    devices = target.devices()
    if len(devices) < target.device_count:
        raise SystemExit(f"target {target.name} needs {target.device_count} devices, this host offers "
                         f"{len(devices)} (CPU: JAX_NUM_CPU_DEVICES)")
    scorer, platform = compose(settings, cfg, None, devices=devices, probe=False)
    log.info("compiling for %s: %d executables, fingerprint %s", target.describe(), scorer.plan.count(cfg.task),
             scorer.exe.fingerprint)
    started = time.perf_counter()
    seconds: dict[tuple, float] = {}
    scorer.exe.warm_up(scorer.plan.programs(cfg.task), timings=seconds)
    total = time.perf_counter() - started
    rows = [executable_report(method, key, scorer.exe.get(method, key), seconds.get((method, key), 0.0),
                              scorer.exe.stored_bytes.get((method, key), 0)) for method, key in seconds]
    limit = target.usable_memory()
    problems = memory_problems(rows, target)
    report = {"target": target.name, "device": target.chip.device_kind, "devices": target.device_count,
              "platform": platform.describe(), "fingerprint": scorer.exe.fingerprint,
              "store": str(scorer.exe.store.directory / scorer.exe.fingerprint), "count": len(rows),
              "total_compile_s": round(total, 2), "serialized_bytes": sum(r["serialized_bytes"] for r in rows),
              "largest_temp_bytes": max((r["temp_bytes"] or 0 for r in rows), default=0),
              "device_memory_limit_bytes": limit,
              "too_large": problems, "executables": rows}
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=1))
    not_stored = [f"{r['method']}{tuple(r['bucket'])}" for r in rows if not r["serialized_bytes"]]
    if not_stored:
        log.warning("%d executables could not be stored (a start compiles them): %s", len(not_stored),
                    ", ".join(not_stored[:10]))
    for problem in problems:
        log.error("%s", problem)
    return report


def main(args: argparse.Namespace) -> int:
    """`scorefn compile --target NAME` (runtime.tools.cli has set JAX_PLATFORMS=cpu for a GPU or TPU target)."""
    try:
        parse_target(args.target)
    except TargetError as exc:
        raise SystemExit(str(exc)) from None
    report = compile_target(args.target, load_settings(), args.json_out)
    summary = {key: value for key, value in report.items() if key != "executables"}
    print(json.dumps(summary), flush=True)
    if report["too_large"]:
        print(f"scorefn compile: {len(report['too_large'])} bucket(s) exceed the memory of {report['device']}:\n"
              + "\n".join(report["too_large"]), file=sys.stderr)
        return 1
    return 0
