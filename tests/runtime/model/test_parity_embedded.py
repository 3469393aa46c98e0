"""The embedded SmolLM2-135M against transformers loading the same GGUF file."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import pytest

from runtime.model.config import load_config
from runtime.model.params import array_shapes
from runtime.assembly.platform import CPU_CLASS_NAMES, cpu_format, fit_to_matmuls, resolve
from runtime.settings import load_settings
from tests.conftest import assert_bfloat16_within_baseline, torch_label_logprobs
from tests.runtime.conftest import scorer_for, small_plan
from tests.runtime.model.test_parity_tiny import ACCELERATOR, TINY_MAX_MARGIN

PARIS, LONDON = 7042, 4528
PROMPTS = [
    "The capital of France is",
    "I pledge allegiance to the flag",
    "What is 2+2? The answer is",
    "This movie was absolutely terrible and boring. Sentiment:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
LABELS = [PARIS, LONDON, 0, 49151, 253, 314, 2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(torch_embedded):
    model, tokenizer = torch_embedded
    sequences = [tokenizer.encode(prompt) for prompt in PROMPTS]
    return sequences, torch_label_logprobs(model, sequences, LABELS)


def test_paris_logprob_matches_the_documented_value(embedded_dir):
    scorer = scorer_for(embedded_dir, "float32", small_plan(lengths=(32,), batches=(1,)))
    paris, london = scorer.score([[504, 3575, 282, 4649, 314]], [PARIS, LONDON])[0]
    assert paris == pytest.approx(-0.258, abs=1e-3)
    assert london == pytest.approx(-4.384, abs=1e-3)


def test_float32_logprobs_match_transformers(embedded_dir, reference):
    sequences, expected = reference
    scorer = scorer_for(embedded_dir, "float32", small_plan(lengths=(32,), batches=(8,)))
    np.testing.assert_allclose(scorer.score(sequences, LABELS), expected, atol=1e-3, rtol=0)


# bfloat16's rule is relative (tests.conftest.assert_bfloat16_within_baseline): scorefn's error against transformers
# float32 no larger than transformers bfloat16's, measured here on this host. Over many prompts, since bfloat16
# rounding is chaotic (which labels move most changes with any change of the float32 path). For context, on an AMD
# EPYC Zen 4 (2026-11-26; 41 prompts x 16 labels, `plausible`: log-prob > -10): transformers bfloat16 mean 0.053,
# p99 0.22, max 0.44; scorefn's bfloat16 (bfloat16 attention, as a CPU runs it) 0.016 / 0.068 / 0.157.
WORDS = ("the a of to and in is was for on that with as by at from his her it an were are which this be or has had "
         "but not they their one all also new more").split()


class Many(NamedTuple):
    """41 prompts x 16 labels: transformers float32's and bfloat16's label log-probabilities, and every position's
    next-token log-probability in each (one forward of each sequence serves both: the same logits)."""
    sequences: list[list[int]]
    labels: list[int]
    expected: np.ndarray
    baseline: np.ndarray
    every_expected: np.ndarray
    every_baseline: np.ndarray


@pytest.fixture(scope="module")
def many(torch_embedded, torch_embedded_bfloat16) -> Many:
    model, tokenizer = torch_embedded
    rng = np.random.default_rng(0)
    texts = PROMPTS + [" ".join(rng.choice(WORDS, int(rng.integers(5, 26)))) for _ in range(36)]
    sequences = [tokenizer.encode(text)[:32] for text in texts]
    labels = list(range(250, 259)) + LABELS
    (expected, every_expected), (baseline, every_baseline) = (
        _label_and_every_position(each, sequences, labels) for each in (model, torch_embedded_bfloat16))
    return Many(sequences, labels, expected, baseline, every_expected, every_baseline)


def _label_and_every_position(model, sequences, labels) -> tuple[np.ndarray, np.ndarray]:
    """tests.conftest.torch_label_logprobs and the next token's log-probability at every position of every sequence
    (tests.runtime.model.test_token_logprobs.torch_log_softmax), from one forward of each sequence."""
    import torch

    rows, every = [], []
    with torch.no_grad():
        for sequence in sequences:
            logits = model(torch.tensor([sequence])).logits[0].double()
            rows.append(torch.log_softmax(logits[-1], dim=-1)[labels].numpy())
            every.append(torch.log_softmax(logits, dim=-1).numpy()[np.arange(len(sequence) - 1), sequence[1:]])
    return np.stack(rows), np.concatenate(every)


@functools.cache
def _each_format(embedded_dir, dtype: str, kernels):
    return scorer_for(embedded_dir, dtype, small_plan(lengths=(32,), batches=(8,)), kernels=kernels)


@pytest.mark.parametrize("cpu_class", CPU_CLASS_NAMES)
def test_each_cpu_class_computes_its_format_within_the_exactness_rules(embedded_dir, many, cpu_class):
    """Every CPU class the platform knows, injected: its format (CPU_FORMATS) with the kernels the platform gives it
    runs here for real (this host computes both formats). float32 within 1e-3 of transformers float32 on every label;
    bfloat16 within the relative rule, on the plausible labels (log-prob > -10) and on the very unlikely ones."""
    sequences, labels, expected, baseline = many.sequences, many.labels, many.expected, many.baseline
    platform = resolve(load_settings(environ={}), backend="cpu", cpu=cpu_format(cpu_class))
    cfg = load_config(embedded_dir)
    platform = fit_to_matmuls(platform, array_shapes(cfg), cfg.head_dim, False, None)
    ours = _each_format(embedded_dir, platform.dtype, platform.kernels).score(sequences, labels)
    if platform.dtype == "float32":
        np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0)
        return
    plausible = expected > -10
    assert plausible.sum() >= 200
    assert_bfloat16_within_baseline(ours[plausible], baseline[plausible], expected[plausible], cpu_class)
    unlikely = ~plausible  # relative to their magnitude: no larger than the baseline's either
    assert_bfloat16_within_baseline(ours[unlikely] / -expected[unlikely], baseline[unlikely] / -expected[unlikely],
                                    expected[unlikely] / -expected[unlikely], f"{cpu_class}, unlikely labels")


def test_the_accelerators_bfloat16_numerics_are_within_the_rule(embedded_dir, many):
    """What GPUs and TPUs compute (bfloat16 weights and attention, float32 softmax and accumulation), through XLA."""
    sequences, labels, expected, baseline = many.sequences, many.labels, many.expected, many.baseline
    ours = _each_format(embedded_dir, "bfloat16", ACCELERATOR).score(sequences, labels)
    plausible = expected > -10
    assert_bfloat16_within_baseline(ours[plausible], baseline[plausible], expected[plausible], "accelerator")


def test_tokenizer_matches_transformers_gguf_tokenizer(embedded_dir, torch_embedded):
    from runtime.model.loader import load_tokenizer

    _, reference_tokenizer = torch_embedded
    tokenizer = load_tokenizer(embedded_dir)
    for text in PROMPTS + ["", " Paris", "naïve café 東京 🙂 <|im_start|>"]:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text)


def test_every_positions_bfloat16_logprobs_are_within_the_rule(embedded_dir, many):
    """/v1/completions' echoed log-probabilities in bfloat16, the head at every position in bfloat16 as transformers
    reads it (runtime.model.heads.VocabHead.positions_weight), with this host's bfloat16 kernels: within the relative
    rule on the plausible positions. (AMD EPYC Zen 4, 2026-11-28, 702 positions: scorefn 0.018 / 0.082 / 0.119 with
    the bfloat16 head, 0.016 / 0.077 / 0.115 with a float32 one; transformers bfloat16 0.046 / 0.159 / 0.274.)
    The max has the tiny configs' margin (EVERY_POSITION_MAX_MARGIN)."""
    sequences, expected, baseline = many.sequences, many.every_expected, many.every_baseline
    plan = small_plan(lengths=(32,), batches=(8,), completion_batches=(8,))
    scorer = scorer_for(embedded_dir, "bfloat16", plan)
    ours = np.concatenate([row.next_logprobs[: len(s) - 1] for row, s in zip(scorer.token_logprobs(sequences),
                                                                              sequences)])
    plausible = expected > -10
    assert plausible.sum() >= 300
    assert_bfloat16_within_baseline(ours[plausible], baseline[plausible], expected[plausible], "every position",
                                    EVERY_POSITION_MAX_MARGIN)


# A maximum over ~500 positions is one position's chaotic rounding, as the tiny configs' (test_parity_tiny's
# TINY_MAX_MARGIN, whose margin it takes). Intel Xeon with AMX (bfloat16 attention), 2026-12-07, 502 positions: scorefn
# 0.021 / 0.084 / 0.441, transformers bfloat16 0.051 / 0.188 / 0.436: the max, 1.01 times the baseline's, is one
# position (the next largest 0.099), and the baseline's largest is another one.
EVERY_POSITION_MAX_MARGIN = TINY_MAX_MARGIN
