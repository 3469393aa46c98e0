"""Bucket layouts (runtime.shapes.layout): the grid and packed rows behind one interface. Whatever the lengths, every
sequence lands in exactly one device batch of a compiled bucket, and the batch's arrays are the program's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from runtime.shapes.buckets import BucketPlan
from runtime.shapes.grid import GridLayout
from runtime.shapes.packed import PackedLayout
from runtime.shapes.programs import ModelShapes

SHAPES = ModelShapes(layers=2, kv_heads=2, head_dim=16, hidden=64, attention_dtype="float32")
LAYOUTS = {"grid": GridLayout((1, 4, 16), (8, 16), (4, 8)),
           "packed": PackedLayout(width=16, rows=(1, 2, 4), narrow=(8,), narrow_continuations=(8,), wide_rows=(1, 2),
                                  slots=(4, 8, 16))}


def plan(layout) -> BucketPlan:
    return BucketPlan(lengths=(8, 16, 32), max_tokens=1024, labels=(4,), context_lengths=(16,), prefix_sharing=True,
                      layout=layout)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 32), min_size=1, max_size=40),
       items=st.lists(st.integers(1, 16), min_size=1, max_size=40))
def test_every_sequence_lands_once_in_a_compiled_bucket_with_the_programs_arrays(name, lengths, items):
    p = plan(LAYOUTS[name])
    layout = p.layout
    for batches, program, buckets, sizes, start in (
            (p.split_full(lengths), layout.full_program, layout.full_buckets(p.limits), lengths, 0),
            (p.split_suffixes(items), layout.continuation_program, layout.continuation_buckets(p.limits), items, 5)):
        assert sorted(i for b in batches for i in b.members) == list(range(len(sizes)))
        sequences = [list(range(1, n + 1)) for n in sizes]
        for batch in batches:
            assert batch.bucket in buckets and len(batch.members) <= batch.head_batch
            assert batch.padded_tokens >= sum(sizes[i] for i in batch.members)
            arrays = batch.arrays(sequences, [i % 3 for i in range(len(sizes))], start)
            arrays = (*arrays[:-1], batch.targets(None, p.label_tokens), arrays[-1])  # as the scorer passes them
            bucket = (16, *batch.bucket) if program is layout.continuation_program else batch.bucket
            specs = program.args(bucket, SHAPES)[-len(arrays):]  # the token arguments (after a context's)
            assert [(a.shape, str(a.dtype)) for a in arrays] == [(tuple(s), d) for s, d in specs]


def test_the_grid_splits_rows_into_the_batches_that_pad_and_launch_least():
    p = plan(LAYOUTS["grid"])
    assert [b.head_batch for b in p.split_full([20] * 5)] == [4, 1]  # not one batch of 16 for 5 rows
    assert [b.head_batch for b in p.split_full([20] * 15)] == [16]  # a batch of 16 pads one row
    tokens, last, adapters = p.split_full([3, 1])[0].arrays([[7, 8, 9], [5]], [2, 1])
    assert tokens.tolist()[:2] == [[7, 8, 9, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 0]] and last.tolist()[:2] == [2, 0]
    assert adapters.tolist() == [2, 1, 0, 0]  # each row's LoRA adapter, padding rows the base


def test_packed_rows_hold_several_sequences_and_read_each_one_slot():
    p = plan(LAYOUTS["packed"])
    (batch,) = p.split_full([5, 4])  # 9 tokens: one row of 16 (at most two sequences a row here)
    tokens, positions, segments, last, adapters = batch.arrays([[1] * 5, [2] * 4], [3, 0])
    assert batch.bucket == (1, 16, 4) and sorted(batch.members) == [0, 1]
    assert np.unique(segments[segments >= 0]).tolist() == [0, 1] and positions.max() == 4
    assert len(last) == 4 and sorted(tokens.flatten()[last[:2]].tolist()) == [1, 2]
    assert ((adapters == 3) == (tokens == 1)).all()  # each token its sequence's LoRA adapter


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_busy_device_runs_the_largest_batch(name):
    p = plan(LAYOUTS[name])
    assert p.layout.full_rows(p.limits, 16) == max(b[0] for b in p.layout.full_buckets(p.limits) if b[1] == 16)
