"""Bad model directories and checkpoints fail with clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.shapes.buckets import SequenceTooLong
from runtime.model.config import ModelConfigError, config_from_hf, load_config
from runtime.model.loader import load_model
from runtime.model.params import array_shapes
from runtime.model.weights import WeightsError, load_arrays
from tests.runtime.conftest import CASES, scorer_for, small_plan, tiny_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    tiny_checkpoint("llama", tmp_path)
    return tmp_path


def _rewrite_weights(model_dir, change):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_missing_config(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model(str(tmp_path), tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelConfigError, match="not a model directory"):
        load_model(str(tmp_path / "nowhere"), tmp_path)


def test_unknown_architecture_is_named():
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel is not supported"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


@pytest.mark.parametrize("arch, why", [("Gemma4ForCausalLM", "another head dimension"),
                                       ("Gemma4ForConditionalGeneration", "per-layer input embeddings"),
                                       ("Qwen3_5ForCausalLM", "gated delta-net"),
                                       ("Qwen3_5MoeForCausalLM", "recurrent state")])
def test_a_family_not_computed_yet_says_what_stands_in_the_way(arch, why):
    with pytest.raises(ModelConfigError, match=f"{arch} is not supported yet: .*{why}"):
        config_from_hf({"architectures": [arch], "model_type": "any"})


def test_unsupported_rope_type_is_named(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ModelConfigError, match="rope type 'proportional' is not supported"):
        config_from_hf(raw)


def test_missing_tensor(checkpoint):
    _rewrite_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_arrays(checkpoint, load_config(checkpoint))


def test_wrong_shape(checkpoint):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    _rewrite_weights(checkpoint, shrink)
    with pytest.raises(WeightsError, match=r"k_proj\.weight has shape \(8, 64\), config implies \(32, 64\)"):
        load_arrays(checkpoint, load_config(checkpoint))


def test_unknown_tensor(checkpoint):
    def add(tensors):
        tensors["model.layers.0.self_attn.mystery.weight"] = np.zeros((2,), np.float32)
    _rewrite_weights(checkpoint, add)
    with pytest.raises(WeightsError, match="unknown tensor.*mystery"):
        load_arrays(checkpoint, load_config(checkpoint))


def test_duplicate_tensor_across_shards(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names}, str(checkpoint / "model-00001-of-00002.safetensors"))
    save_file({names[0]: tensors[names[0]]}, str(checkpoint / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="appears more than once"):
        load_arrays(checkpoint, load_config(checkpoint))


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint, tmp_path_factory):
    single = load_arrays(checkpoint, load_config(checkpoint))
    sharded = tmp_path_factory.mktemp("sharded")
    shutil.copy(checkpoint / "config.json", sharded)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
    weight_map = {n: file for file, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_arrays(sharded, load_config(sharded))
    assert loaded.keys() == single.keys()
    for name in single:
        np.testing.assert_array_equal(loaded[name], single[name])


def test_too_long_sequence_states_limit_and_length(checkpoint):
    scorer = scorer_for(checkpoint, plan=small_plan(lengths=(16, 32)))
    with pytest.raises(SequenceTooLong, match="33 tokens exceeds the longest supported length of 32"):
        scorer.score([[1] * 33], [0])


@pytest.mark.parametrize("case", ["phi3_longrope_partial_sliding", "qwen3_moe_linear_rope", "gemma2",
                                  "olmo2_yarn_rope"])
def test_array_shapes_from_the_config_alone_are_the_loaded_ones(case, tmp_path):
    """What a deviceless compile (no weights) builds the model's abstract parameters from."""
    family, overrides = CASES[case]
    tiny_checkpoint(family, tmp_path, **overrides)
    cfg = load_config(tmp_path)
    assert array_shapes(cfg) == {name: value.shape for name, value in load_arrays(tmp_path, cfg).items()}
