"""Batch in the benchmark: W1-256 as a batch file of W1-256 lines through `scorefn batch` in process (its engine
started before the clock), against W1-256's figure through the scorer in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from runtime.tools.serverproc import SMALL_BUCKETS, scorefn_command
from runtime.tools.workloads import BATCH_LINES, W1_SIZES, w1_batch_file


def run_batch(vocab: int, w1: dict, smoke: bool, dtype: str) -> dict:
    """The batch file's items/s against W1's through the scorer (`w1`: W1's entries by items). Prints its line."""
    batch_items = W1_SIZES[1] if smoke else W1_SIZES[-1]
    entry = _batch_file(vocab, batch_items, 2 if smoke else BATCH_LINES,
                        {**SMALL_BUCKETS, "SCOREFN_DTYPE": dtype} if smoke else {})
    entry["vs_w1"] = entry["items_per_s"] / w1[batch_items]["scorefn"]["items_per_s"]
    print(f"Batch file of {entry['lines']} W1-{batch_items} lines in process: {entry['items_per_s']:.1f} items/s "
          f"({entry['vs_w1']:.2f}x W1-{batch_items}'s {w1[batch_items]['scorefn']['items_per_s']:.1f})", flush=True)
    return entry


def _batch_file(vocab: int, items: int, lines: int, env: dict[str, str]) -> dict:
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
