"""runtime.assembly.bitclasses: the rows from which this host's matmuls keep a row's bits, measured, checked against
row counts the probe did not try, recorded and read back; and what the CPU platform sizes its kernels by."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.model import heads, invariant
from runtime.model.config import config_from_hf
from runtime.model.params import array_shapes
from runtime.assembly import bitclasses
from runtime.assembly import platform as platforms
from runtime.settings import load_settings
from tests.runtime.conftest import EPYC

SHAPES = ((64, 32, "float32"), (32, 65, "float32"), (576, 192, "bfloat16"))


def first_row(x, w, dtype, rows):
    return np.asarray(jax.jit(lambda a, b: jax.lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32))(x[:rows], w))[0]


def test_rows_from_the_floor_keep_their_bits_at_counts_the_probe_did_not_try():
    found = bitclasses.measure(SHAPES)
    rng = np.random.default_rng(0)
    for (inner, outer, dtype), (floor, top) in found.items():
        assert top == bitclasses.ROWS[-1] and floor in bitclasses.ROWS
        x, w = rng.standard_normal((3000, inner)).astype(np.float32), rng.standard_normal((inner, outer))
        w = w.astype(np.float32)
        rows = {m: first_row(x, w, dtype, m) for m in (floor, floor + 5, 2 * floor + 7, 3000)}
        assert all(np.array_equal(r, rows[3000]) for r in rows.values()), (inner, outer, dtype, floor)


def test_the_label_head_gives_a_row_the_same_bits_in_any_batch():
    """runtime.model.heads with the tiles the host's column classes allow (hidden states are the columns of
    weight @ hidden.T): a row's label log-probabilities alone and among 1 to 70 others, at any place."""
    lo, hi = bitclasses.span(((64, 4096, "float32"),), "test", invariant.TILE, invariant.HEAD_TILES, columns=True)
    assert lo <= invariant.TILE <= hi and {lo, hi} <= set(invariant.HEAD_TILES)
    rng = np.random.default_rng(1)
    head = heads.VocabHead(jnp.asarray(rng.standard_normal((4096, 64)), jnp.float32), 1.0, None, (lo, hi))
    hidden = rng.standard_normal((71, 64)).astype(np.float32)
    labels = rng.integers(0, 4096, (71, 4)).astype(np.int32)
    scored = jax.jit(lambda h, l: heads.label_logprobs(head, h, l))
    alone = np.asarray(scored(hidden[:1], labels[:1]))[0]
    for rows in sorted({2, 3, lo + 1, hi - 1, hi, hi + 1, 2 * hi + 3, 71} - {0, 1}):
        assert np.array_equal(np.asarray(scored(hidden[:rows], labels[:rows]))[0], alone), (rows, lo, hi)
        last = np.asarray(scored(np.roll(hidden[:rows], -1, 0), np.roll(labels[:rows], -1, 0)))[rows - 1]
        assert np.array_equal(last, alone), (rows, lo, hi)


def test_a_span_holds_its_reference_and_the_floor_is_recorded_and_read_back(tmp_path, monkeypatch):
    lo, hi = bitclasses.span(SHAPES[:1], "test", 16, (1, 2, 4, 8, 16, 32, 64, 128), tmp_path / "record.json")
    assert lo <= 16 <= hi
    record = tmp_path / "record.json"
    floor = bitclasses.floor(SHAPES, "test", record)
    assert floor == max(lo for lo, _ in bitclasses.measure(SHAPES).values())
    assert floor in json.loads(record.read_text()).values()
    monkeypatch.setattr(bitclasses, "measure", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    bitclasses._measured.cache_clear()
    assert bitclasses.floor(SHAPES, "test", record) == floor  # read, not measured again
    with pytest.raises(AssertionError, match="measured"):  # another CPU's kernels: measured, not read
        bitclasses.floor(SHAPES, "another cpu", record)


def test_the_cpu_platform_sizes_its_invariant_kernels_by_the_host_and_portable_sets_by_the_default(tmp_path,
                                                                                                   monkeypatch):
    cfg = config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
                          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16})
    shapes = array_shapes(cfg)
    record = tmp_path / "bitclasses.json"
    native = platforms.resolve(load_settings(environ={}, dtype="float32"), backend="cpu")
    fitted = platforms.fit_to_matmuls(native, shapes, cfg.head_dim, False, record)
    expected = max(lo for lo, _ in bitclasses.measure(
        invariant.matmul_shapes(shapes, "float32", "float32", cfg.head_dim)).values())
    assert fitted.kernels.min_rows == expected and fitted.kernels.head_rows[0] <= invariant.TILE
    assert "matmuls of at least" in fitted.describe()
    portable = platforms.fit_to_matmuls(native, shapes, cfg.head_dim, True, record).kernels
    assert (portable.min_rows, portable.head_rows) == (invariant.MIN_ROWS, (invariant.TILE, invariant.TILE))
    # A set compiled for another class than the host's (scorefn warmup --cpu-class) is portable too.
    lower = platforms.resolve(load_settings(environ={}, dtype="float32"), backend="cpu",
                              cpu=platforms.cpu_format(platforms.host_cpu(EPYC).feature_class))
    if platforms.host_cpu().feature_class != "avx2":
        assert platforms.fit_to_matmuls(lower, shapes, cfg.head_dim, False, record).kernels.min_rows == \
            invariant.MIN_ROWS
    off = platforms.resolve(load_settings(environ={"SCOREFN_BATCH_INVARIANT": "false"}), backend="cpu")
    assert platforms.fit_to_matmuls(off, shapes, cfg.head_dim, False, record) is off  # nothing to size


def test_expert_tiles_are_the_fewest_rows_that_keep_a_rows_bits_wherever_it_sits(tmp_path):
    """runtime.model.experts multiplies TILES_PER_STEP tiles at once, each by its expert: the probe's tile is one of
    TILES, and with it a row moved to another tile or row comes out with its bits (test_experts.py checks the
    layer); a start reads the answer from its record; without batch invariance a CPU takes CPU_EXPERT_TILE."""
    from runtime.model.experts import TILES_PER_STEP

    shapes = ((64, 96, "float32"), (96, 64, "float32"))
    record = tmp_path / "bitclasses.json"
    tile = bitclasses.tile_rows(shapes, "test", TILES_PER_STEP, record)
    assert tile in bitclasses.TILES and bitclasses._anywhere_alike(shapes, tile, TILES_PER_STEP)
    assert bitclasses.tile_rows(shapes, "test", TILES_PER_STEP, record) == tile and record.is_file()
    moe = {"embed": (128, 64), "layers.experts_gate": (2, 4, 64, 96), "layers.experts_down": (2, 4, 96, 64)}
    off = platforms.resolve(load_settings(environ={"SCOREFN_BATCH_INVARIANT": "false"}), backend="cpu")
    assert platforms.fit_to_matmuls(off, moe, 16, False, record).kernels.expert_tile == platforms.CPU_EXPERT_TILE
