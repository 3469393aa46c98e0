"""`scorefn bench`: its quick path runs end to end and ends with its JSON summary line, a SIGTERM stops what it
started, short timings repeat up to their minimum time, and a workload alternates with its baselines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.tools.bench import measure

pytestmark = pytest.mark.slow

KEYS = {"w1_32_vs_torch_float32", "w2_vs_torch_float32", "w2_vs_torch_float32_prefix_cache",
        "w3_concurrent_vs_serial", "mfu_w1_32", "mfu_w2", "single_item_p50_ms", "w4_tokens_per_s",
        "w4_vs_torch_float32", "w5_sharing_vs_not", "w5_vs_torch_float32_prefix_cache", "lora_w1_vs_base",
        "lora_w2_vs_base", "batch_vs_w1", "w3_traced_vs_off",
        "w6_vs_torch_float32", "w6_vs_torch_float32_prompt_cache", "w7_cache_vs_none", "w7_cache_vs_none_8_clients",
        "w7_vs_torch_float32_past_key_values", "w7_cached_share", "w8_cache_vs_none", "w9_extended_vs_not", "moe_routed_vs_all",
        "moe_routed_vs_dense_active"}


def test_bench_smoke_prints_the_summary_line(tiny_llama_dir):
    # Every workload's code path, on a tiny Llama with SmolLM2's tokenizer (the numbers are not the point here).
    env = {**os.environ, "SCOREFN_DTYPE": "float32", "SCOREFN_MODEL": str(tiny_llama_dir)}
    result = subprocess.run([sys.executable, "-m", "runtime.tools.cli", "bench", "--smoke"], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert KEYS <= summary.keys()
    assert all(isinstance(summary[key], (int, float)) and summary[key] > 0 for key in KEYS), summary
    assert summary["w8_same_bits"] is True  # lm-eval's prompts with the prefix cache: a miss's bits
    assert summary["w9_same_bits"] is True  # queries extended past a cached instruction: a miss's bits
    for line in ("W1  32 items", "W2 200x10x20", "W3 concurrent", "W3 traced", "W4 4x32", "LoRA 2 adapters of rank 4",
                 "W5 rerank 4 documents",
                 "W6 multiple choice 4 items x 2 labels", "W7 few-shot classifier (300-token prompt",
                 "W8 multiple choice through per-position log-probabilities (2 questions of 300 tokens",
                 "W9 paged profiles (300-token instruction cached, 20-token profiles", "Batch file of 2 W1-32 lines in process",
                 "MoE W1-4 (8 experts, 2 routed)"):
        assert line in result.stdout, result.stdout


# A benchmark's child (as `scorefn batch` runs under subprocess.run), then a SIGTERM once the child has started.
CHILD_UNDER_SIGTERM = """
import os, signal, subprocess, sys, threading, time
from runtime.tools.bench.run import unwind_on_sigterm
pid_file = sys.argv[1]

def terminate_once_started():
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)

unwind_on_sigterm()
threading.Thread(target=terminate_once_started).start()
started = f"import os; open({pid_file + '.tmp'!r}, 'w').write(str(os.getpid())); "
started += f"os.rename({pid_file + '.tmp'!r}, {pid_file!r})"
subprocess.run([sys.executable, "-c", started + "; import time; time.sleep(600)"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def test_a_terminated_benchmark_stops_what_it_started(tmp_path):
    # `kill` on a running benchmark once left its `scorefn batch` child busy for minutes.
    pid_file = tmp_path / "child.pid"
    done = subprocess.run([sys.executable, "-c", CHILD_UNDER_SIGTERM, str(pid_file)], capture_output=True, text=True,
                          timeout=60)
    child = int(pid_file.read_text())
    try:
        assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
        assert not _running(child)  # killed and reaped by the benchmark on its way out
    finally:
        if _running(child):  # an orphan: not left behind by a failing run either
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (gone) parent's reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_short_runs_are_repeated_until_they_add_up_to_the_minimum_time(monkeypatch):
    ticks = iter(range(100_000))
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(ticks) / 64)  # every run takes 1/64 s
    calls = []
    assert len(measure.timed_runs(lambda: calls.append(1), 5)) == 5
    assert len(measure.timed_runs(lambda: calls.append(1), 5, min_seconds=30 / 64)) == 30
    assert len(measure.timed_runs(lambda: calls.append(1), 5, min_seconds=60.0)) == 100  # at most 100
    assert len(calls) == 3 + 5 + 30 + 100  # and one warm-up each


def test_a_workload_and_its_baselines_run_in_turns():
    """scorefn and a baseline alternate after one warm run each, a slow baseline fewer times: a slow spell of the
    host falls on both sides of their ratio."""
    calls = []
    times = measure.alternating_runs({"scorefn": lambda: calls.append("s"), "torch": lambda: calls.append("t")},
                                     {"scorefn": 3, "torch": 2})
    assert calls == ["s", "t", "s", "t", "s", "t", "s"]
    assert {name: len(t) for name, t in times.items()} == {"scorefn": 3, "torch": 2}
