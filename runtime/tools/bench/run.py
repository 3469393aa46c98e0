"""`scorefn bench`'s run: the model and the scorers every workload shares, the transformers baselines, each
workload in turn (a module each in this package), the JSON summary; and `--roofline`, which needs no device."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from runtime.assembly import platform as platforms
from runtime.assembly import startup
from runtime.model.config import config_from_hf, load_config
from runtime.model.loader import load_model, resolve_model_dir
from runtime.settings import load_settings
from runtime.tools.baselines import TorchScorer, random_checkpoint
from runtime.tools.bench.adapters import run_lora
from runtime.tools.bench.batch_file import run_batch
from runtime.tools.bench.choice import run_w6
from runtime.tools.bench.compile_times import compile_times
from runtime.tools.bench.experts import run_moe
from runtime.tools.bench.fewshot import run_w7, run_w8
from runtime.tools.bench.http_load import W3_ENV, run_w3
from runtime.tools.bench.lm_eval_mc import run_lm_eval
from runtime.tools.bench.logprobs import run_w4
from runtime.tools.bench.measure import matmul_peak
from runtime.tools.bench.paging import run_w9
from runtime.tools.bench.rerank import run_w5
from runtime.tools.bench.scoring import run_w1, run_w2
from runtime.tools.roofline import padding_report, roofline_report
from runtime.tools.workloads import QWEN3_CONFIG


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

def unwind_on_sigterm() -> None:
    """A SIGTERM (a benchmark stopped by `kill`) unwinds this process as an exception does, so that what it started
    is stopped by its own cleanup: Python's default ends the process at once, and `scorefn batch` (subprocess.run,
    which kills its child on an exception) and W3's server ran on as orphans, busy for minutes."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(args: argparse.Namespace) -> int:
    unwind_on_sigterm()
    if getattr(args, "roofline", None):
        return run_roofline(args)
    # PyTorch's baselines share the GPU: JAX takes memory as it needs it instead of 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # Every workload's runs repeat the same requests, which the prefix cache would answer from memory: each times the
    # computing (its servers and `scorefn batch` inherit this), and W7 times the cache against it.
    os.environ["SCOREFN_PREFIX_CACHE_BYTES"] = "0"
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

    # In this order, which the lines printed and the report's keys follow.
    report["w1"] = run_w1(scorer, baselines, cfg, peak, smoke, repeats, invariant_and_not)
    report.update(run_w2(scorer, baselines, cfg, peak, smoke, quick, accelerator, args.peer, invariant_and_not))
    report["w4"] = run_w4(scorer, baselines, vocab, smoke, quick, invariant_and_not)
    report["lora"] = run_lora(settings, loaded, scorer, vocab, smoke, quick)
    report["w5"] = run_w5(scorer, settings, loaded, baselines, vocab, smoke, quick, invariant_and_not)
    report["w6"] = run_w6(scorer, baselines, vocab, smoke, quick, invariant_and_not)
    report["w7"] = run_w7(scorer, baselines, vocab, smoke, quick)
    report["w8"] = run_w8(scorer, vocab, smoke, quick)
    report["w9"] = run_w9(scorer, vocab, smoke, quick)
    report["moe"] = run_moe(settings, smoke, quick)
    if not config:  # the embedded model (or SCOREFN_MODEL): what `scorefn batch` loads by itself
        report["batch"] = run_batch(vocab, report["w1"], smoke, platform.dtype)
    if not args.skip_http and not config:
        report["w3"] = run_w3(1.0 if smoke else 4.0 if quick else 15.0, 32,
                              {**W3_ENV, "SCOREFN_DTYPE": platform.dtype})
    if not args.skip_http and not config and not smoke:  # real servers and lm-eval: minutes, not the suite's smoke
        report["lm_eval"] = run_lm_eval(Path(model_dir), platform.dtype, quick)
    if args.compile_times:
        report["compile"] = compile_times(Path(model_dir))

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
    w7 = report["w7"]
    summary["w7_cache_vs_none"] = round(w7["cache"]["items_per_s"] / w7["no_cache"]["items_per_s"], 3)
    summary["w7_cache_vs_none_8_clients"] = round(w7["cache_8"]["items_per_s"] / w7["no_cache_8"]["items_per_s"], 3)
    summary["w7_cached_share"] = round(w7["cached_share"], 3)
    for dt in baselines:
        summary[f"w7_vs_torch_{dt}_past_key_values"] = ratio(w7, f"torch_{dt}_prompt_cache")
    summary["w8_cache_vs_none"] = round(report["w8"]["cache_vs_none"], 3)
    summary["w8_same_bits"] = report["w8"]["same_bits"]
    summary["w9_extended_vs_not"] = round(report["w9"]["extended_vs_not"], 3)
    summary["w9_same_bits"] = report["w9"]["same_bits"]
    if report.get("lm_eval"):
        summary["lm_eval_cache_vs_none"] = round(report["lm_eval"]["cache_vs_none"], 3)
        summary["lm_eval_same_loglikelihoods"] = report["lm_eval"]["same_loglikelihoods"]
        summary["lm_eval_same_accuracy"] = report["lm_eval"]["cache"]["accuracy"] == \
            report["lm_eval"]["no_cache"]["accuracy"]
    moe = report["moe"]  # routed experts against all of them and against the dense model of their active parameters
    summary["moe_routed_vs_all"], summary["moe_routed_vs_dense_active"] = moe["routed_vs_all"], \
        moe["routed_vs_dense_active"]
    summary["invariance_cost"]["moe"] = moe["routed"]["invariance_cost"]
    if "w3" in report:
        w3 = report["w3"]
        summary["w3_concurrent_vs_serial"] = round(w3["concurrent"]["items_per_s"] / w3["serial"]["items_per_s"], 3)
        summary["w3_traced_vs_off"] = round(w3["traced"]["traced_vs_off"], 3)
    if "compile" in report:
        summary["compile_cold_s"] = round(report["compile"]["cold"]["compile_s"], 1)
        summary["compile_cached_s"] = round(report["compile"]["cached"]["compile_s"], 1)
    return summary
