"""The benchmark's quick path runs end to end and ends with its JSON summary line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

KEYS = {"w1_32_vs_torch_float32", "w2_vs_torch_float32", "w2_vs_torch_float32_prefix_cache",
        "w3_concurrent_vs_serial", "mfu_w1_32", "mfu_w2", "single_item_p50_ms", "w4_tokens_per_s",
        "w4_vs_torch_float32", "w5_sharing_vs_not", "w5_vs_torch_float32_prefix_cache", "lora_w1_vs_base",
        "lora_w2_vs_base", "batch_vs_w1", "w3_traced_vs_off",
        "w6_vs_torch_float32", "w6_vs_torch_float32_prompt_cache"}


def test_bench_smoke_prints_the_summary_line(tiny_llama_dir):
    # Every workload's code path, on a tiny Llama with SmolLM2's tokenizer (the numbers are not the point here).
    env = {**os.environ, "SCOREFN_DTYPE": "float32", "SCOREFN_MODEL": str(tiny_llama_dir)}
    result = subprocess.run([sys.executable, "-m", "runtime.tools.cli", "bench", "--smoke"], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert KEYS <= summary.keys()
    assert all(isinstance(summary[key], (int, float)) and summary[key] > 0 for key in KEYS), summary
    for line in ("W1  32 items", "W2 200x10x20", "W3 concurrent", "W3 traced", "W4 4x32", "LoRA 2 adapters of rank 4",
                 "W5 rerank 4 documents",
                 "W6 multiple choice 4 items x 2 labels", "Batch file of 2 W1-32 lines in process"):
        assert line in result.stdout, result.stdout
