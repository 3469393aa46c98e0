"""Deviceless compiles for tests/aot/test_deviceless.py, run with the accelerator plugins' venv (.venv-aot):

    JAX_PLATFORMS=cpu .venv-aot/bin/python -m tests.aot.aot_worker '{"xla_dir": ..., "cases": [...]}'

Each case composes a scorer the serving way (runtime.assembly.compose) on a target's compile-only devices from a
config.json alone, compiles the smallest bucket of every entry point (or those named; "every_bucket": all of
them), and reports what
`scorefn compile --json-out` reports for each, plus which layer-loop bodies hold the cuDNN attention call. With
"start_side", it also composes the scorer a start with weights builds on the same devices, for its fingerprint.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable


def computations(hlo: str) -> dict[str, str]:
    """HLO text -> {computation name: its text}."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name, lines = header.group(1), []
        elif line.startswith("}") and name:
            out[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return out


def layer_loops(hlo: str, layers: int) -> tuple[int, int]:
    """(layer-loop bodies holding a cuDNN fused-attention call, layer-loop bodies): while loops that run `layers`
    times, each body searched through the computations it calls."""
    comps = computations(hlo)
    calls = {name: set(re.findall(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", text))
             for name, text in comps.items()}

    def holds_cudnn(name: str, seen: set) -> bool:
        if name in seen or name not in comps:
            return False
        seen.add(name)
        return "__cudnn$fmha" in comps[name] or any(holds_cudnn(c, seen) for c in calls[name])
    bodies = [body for text in comps.values()
              for body, trips in re.findall(r'body=%?([\w.\-]+).*?"known_trip_count":\{"n":"(\d+)"\}', text)
              if int(trips) == layers]
    return sum(holds_cudnn(body, set()) for body in bodies), len(bodies)


def layer_gemms(hlo: str, layers: int) -> tuple[list[str], int]:
    """(The result shapes of every matmul in the layer loop's body, at any depth of the loops inside it; how many of
    the layer-loop bodies hold a Pallas (Triton) kernel): what a row passes through in every layer."""
    comps = computations(hlo)
    bodies = [body for text in comps.values()
              for body, trips in re.findall(r'body=%?([\w.\-]+).*?"known_trip_count":\{"n":"(\d+)"\}', text)
              if int(trips) == layers]
    found: set[str] = set()
    kernels = 0
    for body in bodies:
        seen, todo, triton = set(), [body], False
        while todo:
            name = todo.pop()
            if name in seen or name not in comps:
                continue
            seen.add(name)
            text = comps[name]
            triton |= "__gpu$xla.gpu.triton" in text
            found.update(re.sub(r"\{[^}]*\}", "", shape) for shape, op, rest in
                         re.findall(r"= (\S+) (dot|convolution|custom-call)\(([^\n]*)", text)
                         if op != "custom-call" or "gemm" in rest)
            todo += re.findall(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", text)
        kernels += triton
    return sorted(found), kernels


def in_loops(hlo: str, depth: int, found_in: Callable[[str], set[str]]) -> list[str]:
    """What `found_in` finds in the text of every computation inside at least `depth` nested while loops."""
    comps = computations(hlo)
    found: set[str] = set()

    def visit(name: str, loops: int, seen: set) -> None:
        if (name, loops) in seen or name not in comps:
            return
        seen.add((name, loops))
        text = comps[name]
        if loops >= depth:
            found.update(found_in(text))
        for kind, callee in re.findall(r"(body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", text):
            visit(callee, loops + (kind == "body"), seen)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M)
    if entry:
        visit(entry.group(1), 0, set())
    return sorted(found)


def loop_dots(hlo: str, depth: int = 3) -> list[str]:
    """The result shapes of the matmuls (dots, cuBLAS calls, a TPU's convolutions) inside at least `depth` nested while loops: those of
    the batch-invariant attention's key blocks (layer loop > tile loop > block loop)."""
    return in_loops(hlo, depth, lambda text: {re.sub(r"\{[^}]*\}", "", shape) for shape, op, rest in
                                              re.findall(r"= (\S+) (dot|convolution|custom-call)\(([^\n]*)", text)
                                              if op != "custom-call" or "gemm" in rest})


def loop_kernels(hlo: str) -> list[str]:
    """The custom-call targets inside the layer loop (a TPU's says no trip count): a Mosaic kernel is
    "tpu_custom_call"."""
    return in_loops(hlo, 1, lambda text: set(re.findall(r'custom_call_target="([^"]+)"', text)))


def run(spec: dict) -> dict:
    import numpy as np

    from runtime.model.config import load_config
    from runtime.model.params import array_shapes
    from runtime.assembly.compose import compose
    from runtime.assembly.targets import parse_target
    from runtime.settings import load_settings
    from runtime.tools.compile import executable_report, memory_problems

    out = {}
    for case in spec["cases"]:
        target = parse_target(case["target"])
        devices = target.devices()
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in case.get("settings", {}).items()}
        settings = load_settings(environ={}, compile_cache_dir=spec["xla_dir"], **values)
        cfg = load_config(case["config_dir"])
        scorer, platform = compose(settings, cfg, None, devices=devices, probe=False)
        chosen: dict[tuple, tuple] = {}  # (method, key) -> arguments: the smallest bucket of each, or every one
        for program, key in scorer.plan.programs(cfg.task):
            method = program.name
            first = not any(m == method for m, _ in chosen)
            if (first or case.get("every_bucket")) and (not case.get("methods") or method in case["methods"]):
                chosen[(method, key)] = scorer.exe.specs(program, key)
        rows = []
        for (method, key), args in chosen.items():
            started = time.perf_counter()
            scorer.exe.add(method, key, scorer.exe.lower(method, *args))
            compiled = scorer.exe.get(method, key)
            row = executable_report(method, key, compiled, time.perf_counter() - started,
                                    scorer.exe.stored_bytes.get((method, key), 0))
            row["cudnn_layer_loops"], row["layer_loops"] = layer_loops(compiled.as_text(), cfg.num_layers)
            row["attention_dots"] = loop_dots(compiled.as_text())
            row["layer_gemms"], row["pallas_layer_loops"] = layer_gemms(compiled.as_text(), cfg.num_layers)
            row["loop_gemms"] = loop_dots(compiled.as_text(), 2)  # a TPU's layer loop says no trip count
            row["loop_kernels"] = loop_kernels(compiled.as_text())
            rows.append(row)
        entry = {"platform": platform.describe(), "fingerprint": scorer.exe.fingerprint,
                 "compiler_options": scorer.exe.compiler_options,
                 "devices": scorer.exe.fingerprint_parts["devices"], "executables": rows}
        if "memory_fraction" in case:  # the build-time out-of-memory check, against a device made small
            # (with preallocation, as a GPU runs by default: a caller's XLA_PYTHON_CLIENT_PREALLOCATE=false offers it all)
            preallocate = os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(case["memory_fraction"])
            entry["memory_problems"] = memory_problems(rows, target)
            del os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
            if preallocate is not None:
                os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = preallocate
        if case.get("start_side"):
            rng = np.random.default_rng(0)
            arrays = {name: (rng.standard_normal(shape) * 0.02).astype(np.float32)
                      for name, shape in array_shapes(cfg).items()}
            started, _ = compose(settings, cfg, arrays, devices=devices, probe=False)
            entry["start_fingerprint"] = started.exe.fingerprint
        out[case["name"]] = entry
    return out


if __name__ == "__main__":
    # Warnings are errors, as pytest makes them in the tests (this process is outside its reach). XLA's "Missing
    # deviceless CUB scratch size data for sort" (a GPU sort, such as top-k, compiled without the device falls back
    # to XLA's own sort) is a C++ log line on stderr, not a Python warning: it does not fail a compile.
    warnings.simplefilter("error")
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
