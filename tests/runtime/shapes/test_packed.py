"""Packed rows (runtime.shapes.packed, the accelerators' bucket layout): several sequences per row, each attending
only to itself. The planner's shapes and padding, and scores equal to transformers' and to the grid's, alone or
packed with others, in full or after a shared prefix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.model.config import load_config
from runtime.shapes.packed import Pack, PackedLayout, first_fit, pack_continuations, pack_full
from runtime.requests.jobs import Job
from runtime.settings import load_settings
from tests.conftest import torch_label_logprobs
from tests.runtime.conftest import CASES as MODELS
from tests.runtime.conftest import FreshRope, random_sequences, scorer_for, small_plan, tiny_checkpoint

# Rows of 16 tokens (1 or 2 of them), one narrow row of 8, wide rows of 32; at most 4 sequences per 16 tokens.
PACKING = PackedLayout(width=16, rows=(1, 2), narrow=(8,), narrow_continuations=(8,), wide_rows=(1,), slots=(4, 8),
                       min_item_tokens=4)
PLAN = dataclasses.replace(small_plan(lengths=(16, 32), prefix_sharing=True, contexts=(16, 32)), layout=PACKING)


def test_rows_hold_whole_sequences_within_width_and_slots():
    lengths = [9, 7, 5, 4, 3, 2, 2, 1, 1, 1]
    rows = first_fit(lengths, sorted(range(10), key=lambda i: -lengths[i]), width=16, per_row=4)
    assert sorted(i for row in rows for i in row) == list(range(10))
    assert all(sum(lengths[i] for i in row) <= 16 and len(row) <= 4 for row in rows)


def test_packs_split_into_row_buckets_and_take_narrow_rows():
    assert [(p.rows, p.length) for p in pack_full(PACKING, [5, 2], (16, 32))] == [(1, 8)]  # 7 tokens: one narrow row
    assert [(p.rows, p.length) for p in pack_full(PACKING, [20, 30, 10], (16, 32))] == [(1, 16), (1, 32), (1, 32)]
    packs = pack_continuations(PACKING, [6] * 9)  # 54 tokens, 2 per row (12 of 16): rows 2 + 2 + 1 (narrow)
    assert [(p.rows, p.length, len(p.members)) for p in packs] == [(2, 16, 4), (2, 16, 4), (1, 8, 1)]


def test_arrays_restart_positions_and_mark_padding():
    pack = Pack.of(1, 8, 4, [[1, 0]])
    tokens, positions, segments, last, adapters = pack.arrays([[5, 6, 7], [8, 9]], [0, 2], start=3)
    assert tokens.tolist() == [[8, 9, 5, 6, 7, 0, 0, 0]] and pack.members == [1, 0]
    assert positions.tolist() == [[3, 4, 3, 4, 5, 0, 0, 0]]
    assert segments.tolist() == [[0, 0, 1, 1, 1, -1, -1, -1]]
    assert last.tolist() == [1, 4, 0, 0]
    assert adapters.tolist() == [[2, 2, 0, 0, 0, 0, 0, 0]]


def test_accelerator_buckets_fit_80_executables_and_pad_at_most_1_3x():
    """The real planner on the benchmark's workloads (runtime.tools.roofline): old grid against packed rows. The
    prefix cache's programs come on top, 21 of them: for prompts read at every position (15:
    runtime.shapes.buckets.kept_prompt_contexts) and for contexts extended past their cached part (6: extensions)."""
    from runtime.assembly.compose import bucket_plan
    from runtime.assembly.platform import resolve
    from runtime.tools.roofline import padding_report

    cfg = load_config(_qwen3_dir())
    report = padding_report(load_settings(environ={}, prefix_cache_bytes=0), cfg, "gpu")
    assert report["packed"]["executables"] <= 80 < report["grid"]["executables"]
    settings = load_settings(environ={})
    assert bucket_plan(settings, resolve(settings, "gpu")).count() == report["packed"]["executables"] + 21
    for name, row in report["packed"]["workloads"].items():
        assert row["overhead"] <= 1.3, name
    assert report["grid"]["workloads"]["w1_32"]["overhead"] > 1.3  # items of 21-25 tokens in the grid's batches


def _qwen3_dir(tmp=[]):
    import json
    import tempfile
    from pathlib import Path

    if not tmp:
        directory = Path(tempfile.mkdtemp(prefix="scorefn-qwen3-"))
        source = Path(__file__).resolve().parents[3] / "runtime" / "model" / "configs" / "qwen3-0.6b.json"
        (directory / "config.json").write_text(json.dumps(json.loads(source.read_text())))
        tmp.append(directory)
    return tmp[0]


# Packing touches attention and RoPE: plain causal attention, a sliding window (the mask within a segment), soft-capped
# scores with per-layer windows (Gemma 2: a traced window, XLA's soft-capped path with the segment masks), and RoPE
# whose frequencies depend on the length (dynamic, longrope: from each packed sequence's own length, past 24 tokens).
CASES = ("llama", "mistral_sliding_window", "gemma2", "granite_dynamic_rope", "phi3_longrope_partial_sliding")


@pytest.mark.parametrize("case", CASES)
def test_packed_scores_match_transformers_in_full_and_after_a_shared_prefix(case, tmp_path):
    family, overrides = MODELS[case]
    torch_model = FreshRope(tiny_checkpoint(family, tmp_path, **overrides))
    scorer = scorer_for(tmp_path, "float32", PLAN)
    rng = np.random.default_rng(3)
    query = rng.integers(0, 128, 12).tolist()
    full = random_sequences(rng, 7, 1, 30, 128)  # narrow, W-wide and wide rows
    shared = [query + rng.integers(0, 128, n).tolist() for n in (1, 3, 7, 4, 2, 6, 1)]
    labels = [0, 5, 127, 64]
    for sequences in (full, shared):
        np.testing.assert_allclose(scorer.score(sequences, labels), torch_label_logprobs(torch_model, sequences, labels),
                                   atol=1e-4, rtol=0)
    # The admission estimate (runtime.requests.cost) counts the packs dispatch makes: alone, and as a share of full
    # ones.
    packs = pack_full(PACKING, sorted(map(len, full), reverse=True), PLAN.lengths)
    alone, marginal = scorer.cost([Job(full, labels)]), scorer.cost([Job(full, labels)], marginal=True)
    assert alone.batches == len(packs) and alone.full == sum(p.padded_tokens for p in packs)
    assert 0 < marginal.batches < alone.batches and marginal.full == alone.full
    if scorer.rope_length_limit is not None:  # rows of sequences longer than the limit: their own frequencies
        assert max(map(len, full)) > scorer.rope_length_limit
    assert scorer.prefix_batches >= 1 and {m for m, _ in scorer.exe._compiled} >= {
        "hidden_packed", "hidden_packed_after_context", "prefill_context"}


@pytest.mark.slow
def test_an_item_scores_the_same_alone_and_packed_with_others(embedded_shaped_dir):
    scorer = scorer_for(embedded_shaped_dir, "float32", dataclasses.replace(PLAN, prefix_sharing=False))
    rng = np.random.default_rng(0)
    target, labels = [504, 3575, 282, 4649, 314], [7042, 4528]
    alone = scorer.score([target], labels)[0]
    for others in (random_sequences(rng, 3, 1, 4, 49152), random_sequences(rng, 6, 2, 30, 49152)):
        for row in (0, len(others)):
            batch = others[:row] + [target] + others[row:]
            # Rows of other lengths change XLA:CPU's matmul kernels: float32 rounding, as in test_padding.
            np.testing.assert_allclose(scorer.score(batch, labels)[row], alone, atol=5e-5, rtol=0)
