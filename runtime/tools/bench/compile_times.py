"""`scorefn bench --compile-times`: the default bucket set's warm-up cold and from the persistent cache, each in a
fresh process (`python -m runtime.tools.bench --compile-only MODEL_DIR`, runtime/tools/bench/__main__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.assembly import startup
from runtime.assembly.store import cache_events, enable_persistent_cache
from runtime.model.loader import load_model
from runtime.settings import load_settings


def compile_times(model_dir: Path) -> dict:
    """The default bucket set's warm-up in a fresh process: into an empty persistent cache, then from it. Prints its
    lines."""
    with tempfile.TemporaryDirectory(prefix="scorefn-bench-xla-") as cache:
        runs = {}
        for name in ("cold", "cached"):
            done = subprocess.run([sys.executable, "-m", "runtime.tools.bench", "--compile-only", str(model_dir)],
                                  env={**os.environ, "SCOREFN_COMPILE_CACHE_DIR": cache}, capture_output=True,
                                  text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"compile run failed:\n{done.stderr[-3000:]}")
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    for name, row in runs.items():
        print(f"compile {name:6}: {row['buckets']} buckets in {row['compile_s']:.1f} s "
              f"(persistent cache {row['cache_hits']} hits, {row['cache_misses']} misses)", flush=True)
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
