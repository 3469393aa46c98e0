"""Batch invariance on a GPU, for the days one is lent (skipped elsewhere): SCOREFN_BATCH_INVARIANT=true's kernels
(the token stream in fixed chunks, Pallas attention kernels, no autotuning) score the same bits alone, in batches,
at any row, after a shared prefix, and run after run, on random Qwen3-0.6B-shaped weights; within the bfloat16
exactness rule. The checks are tests/gpu/gpu_checks.py's (which a device run also runs as a script).

    python3 -m pytest tests/gpu      # on a machine with an NVIDIA GPU

What is shown without the device: tests/aot/test_deviceless.py (every bucket's layer body passes its rows through one
set of GEMM shapes and one attention kernel)."""

from __future__ import annotations

import jax
import pytest

from tests.gpu import gpu_checks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (see the module docstring)")]


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    model_dir = gpu_checks.checkpoint(tmp_path_factory.mktemp("qwen3"))
    named, loaded = gpu_checks.scorers(model_dir, tmp_path_factory.mktemp("cache"))
    return named, loaded.cfg.vocab_size, model_dir


def test_every_comparison_is_bitwise_equal_with_the_invariant_kernels(gpu):
    named, vocab, _ = gpu
    found = gpu_checks.invariance(named["invariant"][0], vocab)
    assert found["item_in_batches_equal"][0] == found["item_in_batches_equal"][1], found
    assert found["many_equal"][0] == found["many_equal"][1] and found["rerun_equal"], found
    assert found["prefix_batches"] > 0 and found["prefix_equal"][0] == found["prefix_equal"][1], found


def test_labels_of_several_tokens_keep_their_bits(gpu):
    named, vocab, _ = gpu
    found = gpu_checks.label_invariance(named["invariant"][0], vocab)
    assert found["together_alone_equal"][0] == found["together_alone_equal"][1], found
    assert found["first_token_equal_single_path"], found


def test_the_invariant_kernels_are_within_the_bfloat16_rule(gpu):
    named, vocab, model_dir = gpu
    found = gpu_checks.exactness(named, model_dir, vocab)
    assert found["invariant"]["mean"] <= found["torch_bfloat16"]["mean"], found
    assert found["invariant"]["max"] <= found["torch_bfloat16"]["max"], found
