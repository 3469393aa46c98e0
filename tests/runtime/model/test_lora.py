"""LoRA adapters (runtime.model.lora) against transformers + PEFT in float32 on tiny random configs: random non-zero
A and B (PEFT's init_lora_weights=False), two adapters of different ranks (one rsLoRA) beside the base model, every
path (full rows, a shared prefix, packed rows, every position's log-probabilities) within 1e-4; rows of different
adapters mixed in one device batch; an item's bits the same alone and among other adapters' (batch invariance). And
every adapter a start must refuse, refused naming the adapter and what is wrong."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from runtime.interface import Sampling
from runtime.model import lora
from runtime.model.config import load_config
from runtime.model.kernels import Kernels
from runtime.model.transformer import Transformer
from runtime.model.weights import load_arrays
from runtime.requests.jobs import Job, TokenJob
from runtime.shapes.packed import PackedLayout
from runtime.requests.scorer import Scorer
from tests.conftest import peft_adapter, peft_classifier, torch_label_logprobs
from tests.runtime.conftest import (CASES, FreshRope, random_sequences, small_plan, stored_executables,
                                   tiny_checkpoint)

PLAN = small_plan(lengths=(64,), batches=(8,), labels=(16,), prefix_sharing=True, suffix_lengths=(8,),
                  suffix_batches=(4,), completion_batches=(4,))
PACKED = dataclasses.replace(small_plan(lengths=(16, 32), labels=(16,), prefix_sharing=True), layout=PackedLayout(
    width=16, rows=(1, 2), narrow=(8,), narrow_continuations=(8,), wide_rows=(1,), slots=(4, 8)))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Every tiny case of every family: module names that differ (Phi-3's fused qkv_proj and gate_up_proj), soft-caps
# and sliding windows, q/k norms, experts (Qwen3-MoE: LoRA on attention only), biases, multipliers.
FAMILIES = sorted(CASES)
LABELS = [0, 5, 127, 64]


def adapted_scorer(model_dir, adapters, plan=PLAN, slots: int | None = None, rank: int = 8,
                   kernels: Kernels | None = None) -> Scorer:
    """A float32 scorer of the model in model_dir with these adapters (lora.Adapter) in slots 1..n."""
    cfg = load_config(model_dir)
    arrays = load_arrays(model_dir, cfg)
    arrays |= lora.stacked(adapters, cfg, slots or len(adapters), rank)
    kernels = kernels or Kernels(batch_invariant=plan.layout.name == "grid")
    return Scorer(plan, stored_executables(Transformer(cfg, arrays, "float32", kernels, plan.max_length,
                                                       plan.label_tokens)))


@pytest.fixture(scope="module", params=FAMILIES)
def adapted(request, tmp_path_factory):
    """(references: base and each adapter's PEFT model, the checkpoint's directory, the adapters) of a family."""
    family, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = tiny_checkpoint(family, root / "base", **overrides)
    cfg = load_config(root / "base")
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else ALL
    targets = ATTENTION if cfg.num_experts else names
    references = [base, peft_adapter(base, root / "a", 1, 8, targets),
                  peft_adapter(base, root / "b", 2, 4, targets[1::2], rslora=True)]
    shapes = lora.projection_shapes(cfg)
    adapters = [lora.load_adapter(name, root / name, shapes, cfg.num_layers, "base", 8) for name in ("a", "b")]
    return [FreshRope(model) for model in references], root / "base", adapters


def test_mixed_rows_of_every_adapter_match_peft_on_full_rows_and_after_a_prefix(adapted):
    references, model_dir, adapters = adapted
    scorer = adapted_scorer(model_dir, adapters)
    rng = np.random.default_rng(7)
    sequences = random_sequences(rng, 6, 2, 30, 128)
    jobs = [Job(sequences[i::3], LABELS, adapter=i) for i in range(3)]  # one device batch: base, a and b rows
    for job, ours in zip(jobs, scorer.score_jobs(jobs)):
        reference = torch_label_logprobs(references[job.adapter], job.sequences, LABELS)
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    base_scores = torch_label_logprobs(references[0], sequences[:2], LABELS)
    assert np.abs(torch_label_logprobs(references[1], sequences[:2], LABELS) - base_scores).max() > 0.05
    # A shared prefix: its keys and values computed with the request's adapter.
    query = rng.integers(0, 128, 20).tolist()
    items = [query + rng.integers(0, 128, n).tolist() for n in (3, 7, 5)]
    for adapter in (1, 2):
        before = scorer.prefix_batches
        ours = scorer.score_jobs([Job(items, LABELS, adapter=adapter)])[0]
        assert scorer.prefix_batches > before or scorer.rope_length_limit is not None
        np.testing.assert_allclose(ours, torch_label_logprobs(references[adapter], items, LABELS), atol=1e-4, rtol=0)


def test_every_position_matches_peft(adapted):
    import torch

    references, model_dir, adapters = adapted
    scorer = adapted_scorer(model_dir, adapters)
    sequences = random_sequences(np.random.default_rng(8), 3, 5, 20, 128)
    results = scorer.score_jobs([TokenJob(sequences, [Sampling()] * 3, adapter=1)])[0]
    for ours, sequence in zip(results, sequences):
        with torch.no_grad():
            logits = references[1](torch.tensor([sequence])).logits[0].double()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(sequence) - 1), torch.tensor(sequence[1:])]
        np.testing.assert_allclose(ours.next_logprobs, expected.numpy(), atol=1e-4, rtol=0)


def test_packed_rows_of_mixed_adapters_match_peft(adapted):
    references, model_dir, adapters = adapted
    scorer = adapted_scorer(model_dir, adapters, plan=PACKED)
    sequences = random_sequences(np.random.default_rng(9), 6, 2, 7, 128)  # several sequences a packed row
    jobs = [Job(sequences[i::3], LABELS, adapter=i) for i in range(3)]
    for job, ours in zip(jobs, scorer.score_jobs(jobs)):
        np.testing.assert_allclose(ours, torch_label_logprobs(references[job.adapter], job.sequences, LABELS),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_a_classification_adapter_scores_with_its_own_head_beside_a_causal_one(case, tmp_path):
    """PEFT's SEQ_CLS adapter of the causal LM (LoRA and its own `score` head, modules_to_save): its logits at each
    sequence's last token within 1e-4 of PEFT's, in full rows and after a shared prefix, in the device batches of
    a causal adapter's label scores."""
    import torch

    family, overrides = CASES[case]
    base = tiny_checkpoint(family, tmp_path / "base", **{**overrides, "pad_token_id": 0})
    classifier = peft_classifier(tmp_path / "base", tmp_path / "judge", 3, 3, 8, ["q_proj", "v_proj", "up_proj"])
    causal = peft_adapter(base, tmp_path / "a", 1, 4, ALL)
    cfg = load_config(tmp_path / "base")
    shapes = lora.projection_shapes(cfg)
    adapters = [lora.load_adapter(n, tmp_path / n, shapes, cfg.num_layers, "base", 8) for n in ("judge", "a")]
    assert adapters[0].labels == ("LABEL_0", "LABEL_1", "LABEL_2") and adapters[1].head is None
    scorer = adapted_scorer(tmp_path / "base", adapters)
    rng = np.random.default_rng(11)
    sequences = random_sequences(rng, 5, 2, 30, 128)
    query = rng.integers(0, 128, 20).tolist()
    shared = [query + rng.integers(0, 128, n).tolist() for n in (3, 7, 5)]
    heads, labels, after_prefix = scorer.score_jobs([Job(sequences, [0, 1, 2], adapter=1, head=True),
                                                     Job(sequences, LABELS, adapter=2),
                                                     Job(shared, [0, 1, 2], adapter=1, head=True)])
    with torch.no_grad():
        expected = np.stack([classifier(torch.tensor([s])).logits[0].numpy() for s in sequences + shared])
    np.testing.assert_allclose(np.concatenate([heads, after_prefix]), expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(labels, torch_label_logprobs(causal, sequences, LABELS), atol=1e-4, rtol=0)
    assert np.ptp(expected) > 0.5


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_an_item_has_the_same_bits_alone_and_among_other_adapters(case, tmp_path):
    family, overrides = CASES[case]
    base = tiny_checkpoint(family, tmp_path / "base", **overrides)
    peft_adapter(base, tmp_path / "a", 1, 8, ALL)
    peft_adapter(base, tmp_path / "b", 2, 4, ATTENTION)
    cfg = load_config(tmp_path / "base")
    shapes = lora.projection_shapes(cfg)
    adapters = [lora.load_adapter(n, tmp_path / n, shapes, cfg.num_layers, "base", 8) for n in ("a", "b")]
    scorer = adapted_scorer(tmp_path / "base", adapters, slots=4, kernels=Kernels(batch_invariant=True))
    sequences = random_sequences(np.random.default_rng(3), 8, 3, 30, 128)
    together = scorer.score_jobs([Job(sequences[i::3], LABELS, adapter=i) for i in range(3)])
    for i in range(3):
        for row, sequence in enumerate(sequences[i::3]):
            alone = scorer.score_jobs([Job([sequence], LABELS, adapter=i)])[0][0]
            assert np.array_equal(together[i][row], alone), (i, row)


# ---- what a start refuses ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama, one saved adapter of rank 8 on every projection, and the model's projection shapes."""
    root = tmp_path_factory.mktemp("lora-refusals")
    base = tiny_checkpoint("llama", root / "base")
    peft_adapter(base, root / "good", 1, 8, ALL)
    cfg = load_config(root / "base")
    return root, lora.projection_shapes(cfg)


def edited_copy(root, name: str, **config_changes):
    """A copy of the good adapter under `name` with its adapter_config.json changed."""
    import shutil

    target = root / name
    shutil.copytree(root / "good", target, dirs_exist_ok=True)
    config = json.loads((target / lora.CONFIG).read_text()) | config_changes
    (target / lora.CONFIG).write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("changes", "expected"), [
    ({"r": 32}, "rank 32 is above SCOREFN_MAX_LORA_RANK=16"),
    ({"use_dora": True}, "use_dora=True is not served"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] is not served"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.2-1B"}, "trained on 'meta-llama/Llama-3.2-1B', not on"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
])
def test_a_bad_adapter_fails_naming_it_and_what_is_wrong(llama, changes, expected):
    root, shapes = llama
    path = edited_copy(root, "bad", **changes)
    with pytest.raises(lora.AdapterError, match="LoRA adapter 'bad'") as caught:
        lora.load_adapter("bad", path, shapes, 2, "base", 16)
    assert expected in str(caught.value)


def test_shapes_layers_and_modules_are_checked(llama):
    root, shapes = llama
    narrower = {name: (i, o // 2 if name == "wq" else o) for name, (i, o) in shapes.items()}
    with pytest.raises(lora.AdapterError, match=r"q_proj has lora_A \[8, 64\] and lora_B \[64, 8\]; the served model "
                                                r"needs \[8, 64\] and \[32, 8\]"):
        lora.load_adapter("good", root / "good", narrower, 2, "base", 16)
    with pytest.raises(lora.AdapterError, match="is for layer 1; the model has 1"):
        lora.load_adapter("good", root / "good", shapes, 1, "base", 16)
    attention_only = {name: shape for name, shape in shapes.items() if name in ("wq", "wk", "wv", "wo")}
    served = r"module '(gate|up|down)_proj' cannot take LoRA on this model \(served: \['k_proj'"
    with pytest.raises(lora.AdapterError, match=served):
        lora.load_adapter("good", root / "good", attention_only, 2, "base", 16)
    with pytest.raises(lora.AdapterError, match="needs adapter_config.json and adapter_model.safetensors"):
        lora.load_adapter("missing", root / "nowhere", shapes, 2, "base", 16)


def test_the_adapters_setting_is_parsed_and_bounded(llama):
    root, _ = llama
    assert lora.parse_adapters(f" a={root}/good , b=/x ") == [("a", root / "good"), ("b", lora.Path("/x"))]
    assert lora.slots("a=/x,b=/y", 0) == 2 and lora.slots("", 0) == 0 and lora.slots("a=/x", 8) == 8
    for spec, message in (("a", "'a' is not name=path"), ("a=/x,a=/y", "adapter 'a' is given twice")):
        with pytest.raises(lora.AdapterError, match=message):
            lora.parse_adapters(spec)
    with pytest.raises(lora.AdapterError, match="names 2 adapters, more than SCOREFN_MAX_LORAS=1"):
        lora.load_adapters("a=/x,b=/y", 1, 16, load_config(root / "base"), "base")
