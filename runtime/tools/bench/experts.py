"""The benchmark's mixture-of-experts workload: W1-256's request on a tiny-but-wide Qwen3-MoE (64 experts, 8 routed a
token, seeded random weights), its experts routed (scorefn's default) against every expert on every token
(SCOREFN_EXPERTS=all) and against a dense Qwen3 with the same active parameters (its MLP as wide as 8 experts), in
turns in one process; and the batch-invariant kernels' cost on it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from runtime.assembly import startup
from runtime.model.loader import load_model
from runtime.tools.baselines import random_checkpoint
from runtime.tools.bench.measure import alternating_runs, invariance_cost, summarize
from runtime.tools.workloads import w1_request

EXPERTS, ROUTED, EXPERT_WIDTH = 64, 8, 128
SHAPE = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False}
# --smoke: the code path only, at the smallest shapes
SMOKE = (8, 2, 32, {**SHAPE, "hidden_size": 64, "num_hidden_layers": 1, "head_dim": 16})


def configs(experts: int, routed: int, width: int, shape: dict) -> tuple[dict, dict]:
    """The mixture of experts, and the dense model of its active parameters (its MLP as wide as `routed` experts)."""
    moe = {**shape, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
           "num_experts_per_tok": routed, "moe_intermediate_size": width, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": routed * width}
    dense = {**shape, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": routed * width}
    return moe, dense


def _model(config: dict, directory: Path):
    (directory / "config.json").parent.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return load_model(str(random_checkpoint(directory / "config.json", directory / "weights")), str(directory))


def run_moe(settings, smoke: bool, quick: bool) -> dict:
    """Routed against all experts and against the dense model of the same active parameters; prints its line."""
    items = 4 if smoke else 256
    runs = 2 if smoke else 3 if quick else 7
    experts, top_k, width, shape = SMOKE if smoke else (EXPERTS, ROUTED, EXPERT_WIDTH, SHAPE)
    moe_config, dense_config = configs(experts, top_k, width, shape)
    with tempfile.TemporaryDirectory(prefix="scorefn-moe-") as tmp:
        moe, dense = _model(moe_config, Path(tmp) / "moe"), _model(dense_config, Path(tmp) / "dense")
        routed, platform = startup.scorer(settings, moe, lazy=True)
        scorers = {"routed": routed, "all_experts": startup.scorer(settings.replace(experts="all"), moe, lazy=True)[0],
                   "dense_active": startup.scorer(settings, dense, lazy=True)[0]}
        flipped = startup.scorer(settings.replace(
            batch_invariant="false" if platform.kernels.batch_invariant else "true"), moe, lazy=True)[0]
        sequences, labels = w1_request(shape["vocab_size"], items)
        times = alternating_runs({name: (lambda s=s: s.score(sequences, labels)) for name, s in scorers.items()},
                                 dict.fromkeys(scorers, runs))
        entry = {name: summarize(t, items) for name, t in times.items()}
        entry["routed"]["invariance_cost"] = invariance_cost(
            (routed, flipped) if platform.kernels.batch_invariant else (flipped, routed),
            lambda s: s.score(sequences, labels), runs)
    rate = {name: row["items_per_s"] for name, row in entry.items()}
    entry["routed_vs_all"] = round(rate["routed"] / rate["all_experts"], 3)
    entry["routed_vs_dense_active"] = round(rate["routed"] / rate["dense_active"], 3)
    print(f"MoE W1-{items} ({experts} experts, {top_k} routed): routed {rate['routed']:.1f} items/s, all experts "
          f"{rate['all_experts']:.1f} ({entry['routed_vs_all']:.2f}x), dense of the same active parameters "
          f"{rate['dense_active']:.1f} ({entry['routed_vs_dense_active']:.2f}x), invariance "
          f"{entry['routed']['invariance_cost']:.2f}x", flush=True)
    return entry
