"""Scores the same requests on several device meshes in one process and prints the results as JSON.

JAX fixes its device count when it starts, so tests/runtime/assembly/test_sharding.py runs this module in a subprocess
with JAX_PLATFORMS=cpu and JAX_NUM_CPU_DEVICES=4 (fake CPU devices):

    python -m tests.runtime.assembly.sharding_worker '{"xla_dir": ..., "meshes": [...], "jobs": [...]}'

Each mesh goes through the engine's own scorer construction (runtime.assembly.startup.scorer) and warm-up
(Executables.warm_up); mesh "1x1" is the unsharded single-device runtime, the reference.
"""

from __future__ import annotations

import json
import sys


class _Recording:
    """Executables that note which entry points ran."""

    def __init__(self, exe):
        self.exe, self.ran = exe, set()

    def __call__(self, method, key, *args):
        self.ran.add(method)
        return self.exe(method, key, *args)

    def __getattr__(self, name):
        return getattr(self.exe, name)


def run(spec: dict) -> dict:
    import jax

    from runtime.model.loader import load_model
    from runtime.assembly import startup
    from runtime.assembly import store as executables
    from runtime.settings import load_settings
    from runtime.assembly.sharding import MeshError

    executables.enable_persistent_cache(spec["xla_dir"])
    out: dict = {"devices": [d.platform for d in jax.local_devices()], "jobs": {}}
    for name, job in spec["jobs"].items():
        loaded = load_model(job["model_dir"], spec["cache_dir"])
        results = {}
        for mesh in spec["meshes"]:
            buckets = {key: tuple(v) if isinstance(v, list) else v for key, v in job["settings"].items()}
            settings = load_settings(environ={}, cache_dir=spec["cache_dir"], compile_cache_dir=spec["xla_dir"],
                                     mesh=mesh, **buckets)
            try:
                scorer, _ = startup.scorer(settings, loaded)
            except MeshError as exc:
                results[mesh] = {"error": str(exc)}
                continue
            layout = scorer.exe.shardings
            before = executables.cache_events()
            buckets = scorer.exe.warm_up(scorer.plan.programs(scorer.task))
            warmed = executables.cache_events()
            scorer.exe = recording = _Recording(scorer.exe)
            scores = [scorer.score(sequences, labels).tolist() for sequences, labels in job["requests"]]
            token_logprobs = [t.next_logprobs.tolist() for t in scorer.token_logprobs(job["requests"][0][0])]
            after = executables.cache_events()
            results[mesh] = {
                "scores": scores, "token_logprobs": token_logprobs,
                "layout": layout.describe() if layout is not None else None,
                "param_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(scorer.exe.state)})
                if layout is not None else [],
                "buckets": buckets, "compiles": scorer.exe.compiles, "stored": scorer.exe.loaded + scorer.exe.deferred,
                "cache_hits": warmed["hits"] - before["hits"], "cache_misses": warmed["misses"] - before["misses"],
                "compiles_while_scoring": after["backend_compiles"] - warmed["backend_compiles"],
                "ran": sorted(recording.ran),
            }
        out["jobs"][name] = results
    return out


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(json.loads(sys.argv[1]))))
