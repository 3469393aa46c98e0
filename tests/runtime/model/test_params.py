"""runtime.model.params: every parameter declared once, and what derives from the declarations agrees with them."""

from __future__ import annotations

import pytest

from runtime.model import lora, params
from runtime.model.config import config_from_hf
from runtime.model.weights import weight_map
from tests.runtime.conftest import CASES, FAMILIES, TINY


def _config(case: str):
    transformers = pytest.importorskip("transformers")
    family, overrides = CASES[case]
    config_class, model_class = FAMILIES[family]
    return config_from_hf({**getattr(transformers, config_class)(**{**TINY, **overrides}).to_dict(),
                           "architectures": [model_class]})


@pytest.mark.parametrize("case", ["llama_biases", "phi3_longrope_partial_sliding", "qwen3_moe_linear_rope", "gemma2",
                                  "olmo2_yarn_rope", "gpt_oss"])
def test_the_declarations_hold_together(case):
    cfg = _config(case)
    declared = params.declare(cfg) | lora.declare(cfg, slots=2, rank=4)
    for info in declared.values():
        assert len(info.axes) == len(info.shape), info.name
        assert info.stacked == info.name.startswith("layers.") and (not info.stacked or info.shape[0] == cfg.num_layers)
        # LoRA's targets: a layer's projection [L, I, O] in the model's dtype
        assert not info.lora or (info.stacked and len(info.shape) == 3 and info.dtype is None), info.name
    # the checkpoint's tensors fill exactly the declared arrays (a fused tensor: its parts)
    filled = {part for target in weight_map(cfg).values() for part, _ in target.split or ((target.name, 0),)}
    assert filled == {name for name, info in declared.items() if info.checkpoint is not None}
    assert {name for name, info in declared.items() if info.checkpoint is None} == set(lora.declare(cfg, 2, 4))
