"""Every parameter of the model declared once, from the config (after jax-llm-examples' llama3_jax ArrayInfo): its
name in the model's layout, its shape, the dtype it is kept in, its logical axes, whether LoRA can target it and
where a Hugging Face checkpoint keeps it.

What reads a parameter's facts derives them from here: the checkpoint's tensors and their shape checks
(runtime.model.weights.weight_map), the shapes of a compile without weights (array_shapes), the dtypes the model
keeps (runtime.model.transformer), the projections LoRA stacks updates for (runtime.model.lora) and every
parameter's sharding (runtime.assembly.sharding: which logical axes split over the mesh's model axis).

Layers are stacked: a layer's parameter has a leading LAYERS axis (and Qwen3-MoE's experts an EXPERTS axis after it).
Shapes: L layers, X experts, D hidden, N heads, K KV heads, E head dim, F MLP hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses

from runtime.model.config import ModelConfig

# Logical axes. Sharding splits the attention by HEADS (and KV_HEADS), the MLP and experts by MLP units, the
# embedding and vocabulary head by VOCAB rows; the others, and None (an axis nothing splits), are never split.
LAYERS, EXPERTS, EMBED, HEADS, KV_HEADS, MLP, VOCAB = "layers", "experts", "embed", "heads", "kv_heads", "mlp", "vocab"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where a Hugging Face checkpoint keeps a parameter: `tensor` names it ({layer} and {expert}: the indices of a
    stacked parameter's slice); `transpose`: torch Linear [out, in] -> the model's [in, out]; `offset`: added once
    at load. Parameters declared with the same tensor are the parts of one fused tensor (Phi-3's qkv_proj,
    gate_up_proj), split along its rows in the order of their declaration, or `interleaved` along its last axis
    (gpt-oss's gate_up_proj: gate the even columns, up the odd). `every_expert`: one tensor per layer holds all its
    experts' slices (gpt-oss), not one tensor per expert."""
    tensor: str
    transpose: bool = False
    offset: float = 0.0
    interleaved: bool = False
    every_expert: bool = False


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str  # in the model's layout: embed, layers.wq, ...
    shape: tuple[int, ...]  # [L, ...] for a layer's (stacked), [L, X, ...] for an expert's
    axes: tuple[str | None, ...]  # a logical axis per dimension of the shape
    # None: the model's dtype (SCOREFN_DTYPE: float32 or bfloat16); else always this one
    dtype: str | None
    checkpoint: Checkpoint | None  # None: not in a checkpoint (LoRA's stacked arrays: runtime.model.lora)
    lora: bool = False  # a projection LoRA can target (runtime.model.lora)

    @property
    def stacked(self) -> bool:
        """A layer's parameter, with the layers along its first axis."""
        return self.axes[:1] == (LAYERS,)

    @property
    def slice_axes(self) -> int:
        """How many leading axes stack its slices: 2 for an expert's [L, X, ...], 1 for a layer's, 0 for a whole."""
        return 2 if self.axes[:2] == (LAYERS, EXPERTS) else int(self.stacked)

    @property
    def host_dtype(self) -> str:
        """The dtype of its array as loaded (the `arrays` of runtime.model.transformer.Transformer)."""
        return "int32" if self.dtype == "int32" else "float32"


def norm_names(cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face layer-norm names -> this runtime's: what `post_attention_layernorm` is depends on the family
    (Llama: the norm before the MLP; Gemma 2/3 and OLMo 2: the norm of the attention output)."""
    if cfg.pre_norms and not cfg.post_norms:
        return {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
    names = {"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "mlp_post_norm"}
    if cfg.pre_norms:
        names |= {"input_layernorm": "attn_norm", "pre_feedforward_layernorm": "mlp_norm"}
    return names


# The embedding/vocabulary head stays float32: it runs only at scored positions (cheap) and bfloat16 rounding there
# moves log-probs by more than the body's bfloat16 matmuls do. Norms, biases and the router (its top-k choice) stay
# float32 too; the layers' projections and experts take the model's dtype.
EXACT = "float32"


def declare(cfg: ModelConfig) -> dict[str, ParamInfo]:
    """Every parameter of this model, by name."""
    D, F, E, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    q_out, kv_out = cfg.num_heads * E, cfg.num_kv_heads * E
    norm = lambda tensor: Checkpoint(tensor, offset=cfg.norm_offset)  # Gemma: x * (1 + weight), the 1 added once
    linear = lambda tensor: Checkpoint(tensor, transpose=True)
    layer = "model.layers.{layer}."
    infos = [ParamInfo("embed", (cfg.vocab_size, D), (VOCAB, EMBED), EXACT, Checkpoint("model.embed_tokens.weight")),
             ParamInfo("final_norm", (D,), (EMBED,), EXACT, norm("model.norm.weight"))]
    if cfg.task == "sequence_classification":
        infos.append(ParamInfo("score_head", (cfg.num_labels, D), (None, EMBED), EXACT, Checkpoint("score.weight")))
    elif not cfg.tie_word_embeddings:
        infos.append(ParamInfo("lm_head", (cfg.vocab_size, D), (VOCAB, EMBED), EXACT, Checkpoint("lm_head.weight")))

    def stacked(name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: str | None,
                checkpoint: Checkpoint, lora: bool = False) -> None:
        infos.append(ParamInfo(f"layers.{name}", (L, *shape), (LAYERS, *axes), dtype, checkpoint, lora))

    for hf, name in norm_names(cfg).items():
        stacked(name, (D,), (EMBED,), EXACT, norm(f"{layer}{hf}.weight"))
    # Phi-3 fuses q, k and v, and gate and up: one tensor each, split at load into the parts every family has.
    fused = cfg.family == "phi3"
    q, k, v = (f"{layer}self_attn.{p}_proj.weight" for p in (("qkv",) * 3 if fused else ("q", "k", "v")))
    stacked("wq", (D, q_out), (EMBED, HEADS), None, linear(q), lora=True)
    stacked("wk", (D, kv_out), (EMBED, KV_HEADS), None, linear(k), lora=True)
    stacked("wv", (D, kv_out), (EMBED, KV_HEADS), None, linear(v), lora=True)
    stacked("wo", (q_out, D), (HEADS, EMBED), None, linear(f"{layer}self_attn.o_proj.weight"), lora=True)
    if cfg.family == "gpt_oss":
        _declare_gpt_oss_experts(cfg, stacked)
    elif cfg.num_experts:
        X, Fm = cfg.num_experts, cfg.moe_intermediate_size
        block = layer + ("block_sparse_moe." if cfg.family == "mixtral" else "mlp.")
        gate, up, down = ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        expert = block + "experts.{expert}."
        stacked("router", (D, X), (EMBED, EXPERTS), EXACT, linear(f"{block}gate.weight"))
        stacked("experts_gate", (X, D, Fm), (EXPERTS, EMBED, MLP), None, linear(f"{expert}{gate}.weight"))
        stacked("experts_up", (X, D, Fm), (EXPERTS, EMBED, MLP), None, linear(f"{expert}{up}.weight"))
        stacked("experts_down", (X, Fm, D), (EXPERTS, MLP, EMBED), None, linear(f"{expert}{down}.weight"))
    else:
        gate, up = (f"{layer}mlp.{p}_proj.weight" for p in (("gate_up",) * 2 if fused else ("gate", "up")))
        stacked("w_gate", (D, F), (EMBED, MLP), None, linear(gate), lora=True)
        stacked("w_up", (D, F), (EMBED, MLP), None, linear(up), lora=True)
        stacked("w_down", (F, D), (MLP, EMBED), None, linear(f"{layer}mlp.down_proj.weight"), lora=True)
    if cfg.qkv_bias:
        stacked("bq", (q_out,), (HEADS,), EXACT, Checkpoint(f"{layer}self_attn.q_proj.bias"))
        stacked("bk", (kv_out,), (KV_HEADS,), EXACT, Checkpoint(f"{layer}self_attn.k_proj.bias"))
        stacked("bv", (kv_out,), (KV_HEADS,), EXACT, Checkpoint(f"{layer}self_attn.v_proj.bias"))
    if cfg.o_bias:
        stacked("bo", (D,), (EMBED,), EXACT, Checkpoint(f"{layer}self_attn.o_proj.bias"))
    if cfg.mlp_bias:
        stacked("b_gate", (F,), (MLP,), EXACT, Checkpoint(f"{layer}mlp.gate_proj.bias"))
        stacked("b_up", (F,), (MLP,), EXACT, Checkpoint(f"{layer}mlp.up_proj.bias"))
        stacked("b_down", (D,), (EMBED,), EXACT, Checkpoint(f"{layer}mlp.down_proj.bias"))
    if cfg.attention_sinks:
        stacked("sinks", (cfg.num_heads,), (HEADS,), EXACT, Checkpoint(f"{layer}self_attn.sinks"))
    if cfg.qk_norm:  # per head (E) or over all heads (OLMo 2); never split: a norm over all heads needs them whole
        q_size, kv_size = (E, E) if cfg.qk_norm == "head" else (q_out, kv_out)
        stacked("q_norm", (q_size,), (None,), EXACT, norm(f"{layer}self_attn.q_norm.weight"))
        stacked("k_norm", (kv_size,), (None,), EXACT, norm(f"{layer}self_attn.k_norm.weight"))
    return {info.name: info for info in infos}


def _declare_gpt_oss_experts(cfg: ModelConfig, stacked) -> None:
    """gpt-oss's router (weight and bias) and experts: each layer's in one tensor per projection and bias, already
    [in, out]; gate and up interleaved in gate_up_proj (and its bias)."""
    D, X, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    block = "model.layers.{layer}.mlp."
    experts = lambda name, interleaved=False: Checkpoint(f"{block}experts.{name}", interleaved=interleaved,
                                                          every_expert=True)
    stacked("router", (D, X), (EMBED, EXPERTS), EXACT, Checkpoint(f"{block}router.weight", transpose=True))
    # (not EXPERTS: a stacked [L, X] parameter led by LAYERS, EXPERTS would be read as one slice per expert)
    stacked("router_bias", (X,), (None,), EXACT, Checkpoint(f"{block}router.bias"))
    stacked("experts_gate", (X, D, F), (EXPERTS, EMBED, MLP), None, experts("gate_up_proj", True))
    stacked("experts_up", (X, D, F), (EXPERTS, EMBED, MLP), None, experts("gate_up_proj", True))
    stacked("experts_down", (X, F, D), (EXPERTS, MLP, EMBED), None, experts("down_proj"))
    stacked("b_experts_gate", (X, F), (EXPERTS, MLP), EXACT, experts("gate_up_proj_bias", True))
    stacked("b_experts_up", (X, F), (EXPERTS, MLP), EXACT, experts("gate_up_proj_bias", True))
    stacked("b_experts_down", (X, D), (EXPERTS, EMBED), EXACT, experts("down_proj_bias"))


def array_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every array's shape in the model's layout, from the config alone (compiling needs no weights)."""
    return {name: info.shape for name, info in declare(cfg).items()}
