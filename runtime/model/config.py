"""Model configuration: one frozen dataclass built from a Hugging Face config.json by one function.

Every architecture is the same decoder layer; what differs between families is data here (norm style, activation,
multipliers, soft-caps, which norms exist, q/k norms, per-layer sliding windows and RoPE bases, experts), read the
way transformers reads it, with transformers' defaults for fields a config.json leaves out. Fields that would
change the math in a way this runtime does not compute are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from runtime.model.rope import Rope, RopeError, parse_rope


class ModelConfigError(ValueError):
    """The model directory or its config.json cannot be served."""


# architecture name in config.json -> (family, task)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "MistralForCausalLM": ("mistral", "causal_lm"),
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "causal_lm"),
    "MixtralForCausalLM": ("mixtral", "causal_lm"),
    "OlmoeForCausalLM": ("olmoe", "causal_lm"),
    "GptOssForCausalLM": ("gpt_oss", "causal_lm"),
    "GemmaForCausalLM": ("gemma", "causal_lm"),
    "Gemma2ForCausalLM": ("gemma2", "causal_lm"),
    "Gemma3ForCausalLM": ("gemma3", "causal_lm"),
    "Phi3ForCausalLM": ("phi3", "causal_lm"),
    "GraniteForCausalLM": ("granite", "causal_lm"),
    "Olmo2ForCausalLM": ("olmo2", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "sequence_classification"),
    "Qwen2ForSequenceClassification": ("qwen2", "sequence_classification"),
    "Qwen3ForSequenceClassification": ("qwen3", "sequence_classification"),
    "GemmaForSequenceClassification": ("gemma", "sequence_classification"),
    "Gemma2ForSequenceClassification": ("gemma2", "sequence_classification"),
    "Gemma3TextForSequenceClassification": ("gemma3", "sequence_classification"),
    "Phi3ForSequenceClassification": ("phi3", "sequence_classification"),
}

# Architectures of transformers' that this runtime does not compute yet -> what stands in the way: a start names it.
# Every layer here runs one compiled body of one shape, and a shared prefix is its keys and values.
_GEMMA4 = ("its full-attention layers have another head dimension (global_head_dim) and number of KV heads than its "
           "sliding ones, its layers add per-layer input embeddings (hidden_size_per_layer_input), and its last "
           "layers reuse earlier layers' keys and values (num_kv_shared_layers); scorefn runs every layer as one "
           "body of one shape")
_GATED_DELTA_NET = ("most of its layers are gated delta-net linear attention, whose context is a recurrent state, "
                    "not keys and values; scorefn's layers, shared prefixes and prefix cache hold keys and values")
NOT_YET: dict[str, str] = {
    "Gemma4ForCausalLM": _GEMMA4, "Gemma4ForConditionalGeneration": _GEMMA4,
    "Qwen3_5ForCausalLM": _GATED_DELTA_NET, "Qwen3_5ForConditionalGeneration": _GATED_DELTA_NET,
    "Qwen3_5MoeForCausalLM": _GATED_DELTA_NET, "Qwen3_5MoeForConditionalGeneration": _GATED_DELTA_NET,
    "Qwen3_5ForSequenceClassification": _GATED_DELTA_NET, "Qwen3_5TextForSequenceClassification": _GATED_DELTA_NET,
    "Qwen3NextForCausalLM": _GATED_DELTA_NET,
}
GEMMA = ("gemma", "gemma2", "gemma3")
# transformers' defaults (5.x config classes) for math-relevant fields a config.json may leave out.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
              "max_position_embeddings": 8192},
    "gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "max_position_embeddings": 8192},
    "gemma3": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
               "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6, "max_position_embeddings": 131_072},
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
    "olmo2": {"rms_norm_eps": 1e-5},
    "granite": {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                "attention_multiplier": 1.0},
    "qwen3_moe": {"num_experts_per_tok": 8, "norm_topk_prob": False,
                  "moe_intermediate_size": 768, "decoder_sparse_step": 1},
    # Mixtral's and OLMoE's experts are intermediate_size wide; Mixtral always renormalizes its top-k.
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5},
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rms_norm_eps": 1e-5},
    "gpt_oss": {"num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
                "rope_theta": 150_000.0, "attention_bias": True, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 131_072, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}
# GptOssConfig's rope_parameters when a config.json has none
DEFAULT_ROPE = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096}}
MOE = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | olmoe | gpt_oss | gemma | gemma2 | gemma3 |
    # phi3 | granite | olmo2
    task: str  # causal_lm | sequence_classification
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope  # of every layer, or of the global (full-attention) layers when local_rope is set
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or attention_bias
    o_bias: bool  # attention_bias (not Qwen2)
    mlp_bias: bool
    qk_norm: str | None  # "head": per head (Qwen3, Gemma 3); "projection": over all heads (OLMo 2)
    sliding_window: int | None  # the window of the sliding layers (all layers unless sliding_layers says)
    max_position_embeddings: int
    num_labels: int = 0  # sequence classification heads
    id2label: tuple[str, ...] = ()
    pad_token_id: int | None = None
    problem_type: str | None = None  # sequence classification: "multi_label_classification" reads with sigmoid
    # ---- what differs between families (defaults: Llama) ----
    activation: str = "silu"  # silu | gelu_tanh (GeGLU) | clamped_swiglu (gpt-oss's experts: swiglu_limit, _alpha)
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight); the 1 is added to the weights at load
    pre_norms: bool = True  # RMSNorm before attention and MLP (all but OLMo 2)
    post_norms: bool = False  # RMSNorm of the attention / MLP output before the residual add (Gemma 2/3, OLMo 2)
    embed_scale: float = 1.0  # Gemma: sqrt(hidden) (float32, as transformers); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: residual_multiplier on each branch
    logits_divisor: float = 1.0  # Granite: logits_scaling
    attention_scale: float | None = None  # None: head_dim ** -0.5; Gemma 2/3: query_pre_attn_scalar ** -0.5
    attention_softcap: float | None = None  # Gemma 2: tanh soft-cap of the attention scores
    final_softcap: float | None = None  # Gemma 2/3: tanh soft-cap of the vocabulary logits
    sliding_layers: tuple[bool, ...] | None = None  # per layer: sliding (True) or global; None: all alike
    local_rope: Rope | None = None  # Gemma 3: the sliding layers' RoPE (rope_local_base_freq)
    num_experts: int = 0  # Qwen3-MoE: routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k router probabilities to sum to 1
    # ---- gpt-oss ----
    attention_sinks: bool = False  # a learned logit per head in each query's softmax denominator (`sinks`)
    router_top_k_first: bool = False  # the softmax over the top-k router logits (not the top-k of the softmax)
    expert_biases: bool = False  # biased router and experts' projections
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_limit: float = 7.0  # clamped_swiglu: the gate clamped above, up on both sides
    quantization: str | None = None  # "mxfp4": the experts' weights as FP4 blocks, dequantized at load

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def logit_dim(self) -> int:
        return self.num_labels if self.task == "sequence_classification" else self.vocab_size

    def layer_is_sliding(self) -> tuple[bool, ...]:
        if self.sliding_window is None:
            return (False,) * self.num_layers
        return self.sliding_layers or (True,) * self.num_layers

    def non_embedding_params(self) -> int:
        """Weights each token runs through (with experts: the ones it is routed to)."""
        d, h, f = self.hidden_size, self.head_dim, self.intermediate_size
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * f if not self.num_experts else self.experts_per_token * 3 * d * self.moe_intermediate_size
        return self.num_layers * (attn + mlp)

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs of one token attending to `context` keys, vocabulary projection excluded."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context
        return 2.0 * self.non_embedding_params() + attention


def _refuse(condition: bool, arch: str, message: str) -> None:
    if condition:
        raise ModelConfigError(f"{arch}: {message}")


def _ropes(raw: dict[str, Any], family: str, arch: str, head_dim: int) -> tuple[Rope, Rope | None]:
    """(rope of every layer or of the global layers, rope of Gemma 3's sliding layers)."""
    max_pos = int(raw.get("max_position_embeddings") or 2048)
    theta = float(raw.get("rope_theta") or 10000.0)
    partial = float(raw.get("partial_rotary_factor") or 1.0)
    _refuse(partial != 1.0 and family != "phi3", arch, f"partial_rotary_factor {partial} is not supported "
            "for this architecture (transformers rotates the whole head)")
    original = raw.get("original_max_position_embeddings") if family == "phi3" else None
    allowed = ("default", "longrope") if family == "phi3" else None

    def parse(params: dict[str, Any], where: str, theta: float = theta) -> Rope:
        params = dict(params)
        if family == "phi3" and params.get("rope_type", params.get("type")) in ("su", "yarn"):
            params["rope_type"] = "longrope"  # Phi3Config's renaming of older configs
            params.pop("type", None)
        return parse_rope(params, theta=theta, head_dim=head_dim, partial=partial, max_position_embeddings=max_pos,
                          original_max=original, allowed=allowed, where=where)

    params = raw.get("rope_parameters") or raw.get("rope_scaling") or DEFAULT_ROPE.get(family, {})
    try:
        if family != "gemma3":
            return parse(params, arch), None
        # Gemma 3: rope_parameters by layer type (transformers >= 5), or rope_theta + rope_scaling (global layers)
        # and rope_local_base_freq (sliding layers).
        if "full_attention" in params or "sliding_attention" in params:
            full = params.get("full_attention") or {}
            local = params.get("sliding_attention") or {}
        else:
            full, local = params, {}
        local_theta = float(raw.get("rope_local_base_freq") or 10000.0)
        return parse(full, f"{arch} (global layers)"), parse(local, f"{arch} (sliding layers)", local_theta)
    except RopeError as exc:
        raise ModelConfigError(str(exc)) from exc


def _sliding(raw: dict[str, Any], family: str, arch: str, layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window of the sliding layers, which layers slide: None for all)."""
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        _refuse(bool(raw.get("use_sliding_window")), arch, "use_sliding_window=true is not supported")
        return None, None
    if family in ("mistral", "phi3", "mixtral"):
        window = raw.get("sliding_window")
        return (int(window) if window else None), None
    if family not in ("gemma2", "gemma3", "gpt_oss"):
        return None, None
    types = raw.get("layer_types")
    if types is None:  # transformers' pattern: Gemma 2, gpt-oss alternate from a sliding layer; Gemma 3: 5 of 6 slide
        pattern = int(raw.get("sliding_window_pattern") or 6) if family == "gemma3" else 2
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    _refuse(bool(unknown), arch, f"layer_types {unknown} are not supported")
    _refuse(len(types) != layers, arch, f"layer_types lists {len(types)} layers, the model has {layers}")
    window = raw.get("sliding_window")
    return (int(window) if window else None), tuple(t == "sliding_attention" for t in types)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json; reject what we cannot run exactly."""
    architectures = raw.get("architectures") or []
    arch = architectures[0] if architectures else f"<model_type {raw.get('model_type')!r}>"
    if arch in NOT_YET:
        raise ModelConfigError(f"architecture {arch} is not supported yet: {NOT_YET[arch]}")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelConfigError(f"architecture {arch} is not supported (supported: {supported})")
    family, task = ARCHITECTURES[arch]
    raw = {"max_position_embeddings": 2048, **DEFAULTS.get(family, {}), **raw}  # an explicit null stays null
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(raw["num_hidden_layers"])
        _refuse(heads % kv_heads != 0, arch, f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
        act_key = "hidden_activation" if family in ("gemma2", "gemma3") else "hidden_act"
        act = raw.get(act_key, "silu")
        act = "gelu_pytorch_tanh" if family == "gemma" and act == "gelu" else act  # GemmaConfig's own fix-up
        _refuse(act not in ACTIVATIONS, arch, f"{act_key} {act!r} is not supported (supported: {sorted(ACTIVATIONS)})")
        _refuse(family in GEMMA and bool(raw.get("use_bidirectional_attention")), arch,
                "use_bidirectional_attention=true is not supported (causal attention only)")
        rope, local_rope = _ropes(raw, family, arch, head_dim)
        window, sliding_layers = _sliding(raw, family, arch, layers)
        # Qwen3MoeConfig saves num_experts as num_local_experts (its attribute map); its default is 128.
        experts = int(raw.get("num_experts", raw.get("num_local_experts", 128))) if family in MOE else 0
        _refuse(family == "olmoe" and raw.get("clip_qkv") is not None, arch, "clip_qkv is not supported")
        if family == "qwen3_moe":
            dense = raw.get("mlp_only_layers") or []
            step = int(raw.get("decoder_sparse_step") or 1)
            _refuse(bool(dense) or step != 1 or experts <= 0, arch,
                    f"dense MLP layers among expert layers (mlp_only_layers={dense}, decoder_sparse_step={step}, "
                    f"num_experts={experts}) are not supported: every layer must route to experts")
        attention_bias = bool(raw.get("attention_bias", False)) and family != "phi3"
        quantization = (raw.get("quantization_config") or {}).get("quant_method")
        _refuse(quantization is not None and not (family == "gpt_oss" and quantization == "mxfp4"), arch,
                f"quantization_config quant_method {quantization!r} is not supported (gpt-oss: mxfp4 only)")
        num_labels = 0
        id2label: tuple[str, ...] = ()
        if task == "sequence_classification":
            mapping = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()}
            num_labels = int(raw.get("num_labels") or len(mapping) or 2)
            id2label = tuple(mapping.get(i, f"LABEL_{i}") for i in range(num_labels))
        granite, gpt_oss = family == "granite", family == "gpt_oss"
        return ModelConfig(
            architecture=arch, family=family, task=task,
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope=rope, local_rope=local_rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)) and family in ("llama", "granite"),
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmo2": "projection",
                     "olmoe": "projection"}.get(family),
            sliding_window=window, sliding_layers=sliding_layers,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            num_labels=num_labels, id2label=id2label,
            pad_token_id=raw.get("pad_token_id") if isinstance(raw.get("pad_token_id"), int) else None,
            problem_type=raw.get("problem_type") if isinstance(raw.get("problem_type"), str) else None,
            activation="clamped_swiglu" if gpt_oss else ACTIVATIONS[act],
            norm_offset=1.0 if family in GEMMA else 0.0,
            pre_norms=family != "olmo2", post_norms=family in ("gemma2", "gemma3", "olmo2"),
            embed_scale=(_float32(hidden ** 0.5) if family in GEMMA
                         else float(raw["embedding_multiplier"]) if granite else 1.0),
            residual_scale=float(raw["residual_multiplier"]) if granite else 1.0,
            logits_divisor=float(raw["logits_scaling"]) if granite else 1.0,
            attention_scale=(float(raw["query_pre_attn_scalar"]) ** -0.5 if family in ("gemma2", "gemma3")
                             else float(raw["attention_multiplier"]) if granite else None),
            # Gemma 3 keeps attn_logit_softcapping in its config but transformers never applies it; neither do we.
            attention_softcap=_cap(raw.get("attn_logit_softcapping")) if family == "gemma2" else None,
            final_softcap=_cap(raw.get("final_logit_softcapping")) if family in ("gemma2", "gemma3") else None,
            num_experts=experts, experts_per_token=int(raw["num_experts_per_tok"]) if experts else 0,
            moe_intermediate_size=int(raw["moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"])
            if experts else 0,
            norm_topk_prob=(family == "mixtral" or bool(raw.get("norm_topk_prob"))) if experts else False,
            attention_sinks=gpt_oss, router_top_k_first=gpt_oss, expert_biases=gpt_oss,
            swiglu_alpha=float(raw.get("swiglu_alpha") or 1.702), swiglu_limit=float(raw.get("swiglu_limit") or 7.0),
            quantization=quantization,
        )
    except KeyError as exc:
        raise ModelConfigError(f"{arch}: config.json lacks required field {exc.args[0]!r}") from exc


def _float32(value: float) -> float:
    """A Python float holding the float32 value transformers multiplies by (torch.tensor(value))."""
    return float(np.float32(value))


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: invalid JSON: {exc}") from exc
    return config_from_hf(raw)
