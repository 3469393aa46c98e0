"""Portable CPU executables: `scorefn warmup --cpu-class avx2` compiles a set that an AVX2 host runs, whatever the
host that compiles it. XLA:CPU's loader only logs when an executable needs a feature the host lacks (the
executable may then stop on an illegal instruction), so the proof is the machine code itself: disassembled, the
capped set holds no AVX-512, AMX or VNNI instruction, where a set compiled natively on an AVX-512 host does."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import serialize_executable

from runtime.assembly.platform import CPU_CLASS_NAMES, host_cpu
from runtime.tools.serverproc import scorefn_command

pytestmark = pytest.mark.slow

# Registers and mnemonics only AVX-512 (EVEX), AMX and the VNNI extensions have: an AVX2 host (Haswell, Zen) has
# none of them. EVEX instructions on ymm0-15 without a mask show as one of the mnemonics.
BEYOND_AVX2 = re.compile(
    r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\b(vpternlog|vperm[it]2|vpermw|vpermb|vpcompress|vpexpand|vcompress|"
    r"vexpand|vrndscale|vscalef|vgetexp|vgetmant|vfixupimm|vrange|vreduce|vrcp14|vrsqrt14|vpmov[dqw][bdw]|"
    r"vpmovus|vpmovs[dqw]|vpabsq|vp(max|min)[su]q|vpmullq|vpsraq|vcvt\w*[2u]?qq|vcvt\w*2u|vcvtu|vpconflict|"
    r"vplzcnt|kmov|kor|kand|vdpbf16|vcvtne\w*bf16|vpdpbusd|vpdpwssd|tdp|tileload|ldtilecfg)")
OBJDUMP = shutil.which("objdump")


def instructions_beyond_avx2(blob: bytes) -> list[str]:
    """The disassembled instructions of every object file in a serialized XLA:CPU executable that an AVX2 host
    does not have."""
    found = []
    starts = [m.start() for m in re.finditer(rb"\x7fELF", blob)]
    assert starts, "no object file in the executable"
    with tempfile.TemporaryDirectory() as directory:
        for i, start in enumerate(starts):
            obj = Path(directory) / f"{i}.o"
            obj.write_bytes(blob[start:starts[i + 1] if i + 1 < len(starts) else len(blob)])
            done = subprocess.run([OBJDUMP, "-d", "--no-show-raw-insn", str(obj)], capture_output=True, check=True)
            found += [line.strip() for line in done.stdout.decode().splitlines() if BEYOND_AVX2.search(line)]
    return found


def stored_blob(path) -> bytes:
    serialized, _, _ = pickle.loads(zlib.decompress(path.read_bytes()))
    return serialized


@pytest.mark.skipif(OBJDUMP is None, reason="objdump (binutils) disassembles the executables")
def test_the_avx2_set_holds_no_instruction_beyond_avx2(tiny_llama_dir, cache_dir, tmp_path):
    env = {**os.environ, "SCOREFN_MODEL": str(tiny_llama_dir), "SCOREFN_CACHE_DIR": str(cache_dir),
           "SCOREFN_COMPILE_CACHE_DIR": str(tmp_path / "xla"), "SCOREFN_LENGTH_BUCKETS": "16",
           "SCOREFN_BATCH_BUCKETS": "4", "SCOREFN_PREFIX_SHARING": "false", "SCOREFN_COMPLETION_BATCH_BUCKETS": "1",
           "SCOREFN_MAX_LABELS": "4"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(scorefn_command("warmup", "--cpu-class", "avx2"), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [manifest] = (tmp_path / "xla" / "executables").glob("*/manifest.json")
    parts = json.loads(manifest.read_text())
    assert parts["cpu"] == "avx2" and not any(key == "XLA_FLAGS" for key, _ in parts["env"])  # the cap is "cpu"
    assert parts["model"][1] == "float32"  # the format an AVX2 host computes in
    sets = list(manifest.parent.glob("*.jaxexe"))
    assert sets and all(instructions_beyond_avx2(stored_blob(path)) == [] for path in sets)


@pytest.mark.skipif(OBJDUMP is None, reason="objdump (binutils) disassembles the executables")
@pytest.mark.skipif(CPU_CLASS_NAMES.index(host_cpu().feature_class) > CPU_CLASS_NAMES.index("avx512"),
                    reason="the host has no AVX-512 for a native compile to use")
def test_a_native_compile_on_an_avx512_host_uses_it():
    """The detector sees what the capped compile leaves out (else the test above could not fail)."""
    # A constant of this run makes the program new: one the tests' persistent cache holds (from an earlier run in
    # this checkout) loads from it, and serializes without its object files.
    salt = np.float32(time.time_ns() % 100_003)

    def mlp(x, w_up, w_down):  # a layer's shape: bfloat16 matmuls, an activation, a norm, a softmax
        h = jax.nn.silu(jnp.einsum("td,df->tf", x.astype(jnp.bfloat16), w_up, preferred_element_type=jnp.float32))
        y = jnp.einsum("tf,fd->td", h.astype(jnp.bfloat16), w_down, preferred_element_type=jnp.float32)
        return jax.nn.softmax(y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6) + x, -1) + salt
    args = (np.ones((384, 576), np.float32), jnp.ones((576, 1536), jnp.bfloat16), jnp.ones((1536, 576), jnp.bfloat16))
    compiled = jax.jit(mlp).lower(*args).compile()
    assert instructions_beyond_avx2(serialize_executable.serialize(compiled)[0])


def test_warmup_refuses_a_class_it_cannot_compile_for():
    unknown = subprocess.run(scorefn_command("warmup", "--cpu-class", "sse9"), capture_output=True, text=True,
                             timeout=120)
    assert unknown.returncode == 2 and "unknown CPU class sse9; known: amx, avx512_bf16" in unknown.stderr
    if host_cpu().feature_class != "amx":  # on an AMX host every class is at or below the host's
        above = subprocess.run(scorefn_command("warmup", "--cpu-class", "amx"), capture_output=True, text=True,
                               timeout=120)
        assert above.returncode == 2 and "cannot compile for class amx" in above.stderr
