"""The benchmark's quick path runs end to end and ends with its JSON summary line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

KEYS = {"w1_32_vs_torch_bfloat16", "w1_32_vs_torch_float32", "w2_vs_torch_bfloat16",
        "w2_vs_torch_bfloat16_prefix_cache", "w3_concurrent_vs_serial", "mfu_w1_32", "mfu_w2", "single_item_p50_ms"}


def test_bench_smoke_prints_the_summary_line():
    result = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "--smoke"], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "SCOREFN_DTYPE": "float32"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert KEYS <= summary.keys()
    assert all(isinstance(summary[key], float) and summary[key] > 0 for key in KEYS), summary
    assert "W1  32 items" in result.stdout and "W2 200x10x20" in result.stdout and "W3 concurrent" in result.stdout
