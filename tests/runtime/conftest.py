"""Runtime test helpers: small bucket plans, tiny random Hugging Face checkpoints of every supported architecture,
and one compiled scorer per tiny case shared by the parity tests of every path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime.shapes.buckets import BucketPlan
from runtime.assembly.executables import Executables
from runtime.shapes.grid import GridLayout
from runtime.model.config import load_config
from runtime.model.kernels import Kernels
from runtime.model.transformer import Transformer
from runtime.assembly.platform import fit_to_matmuls, resolve
from runtime.requests.launch import cpu_threads
from runtime.requests.scorer import Scorer
from runtime.settings import load_settings
from runtime.model.params import array_shapes
from runtime.model.weights import load_arrays
from runtime.assembly.store import ExecutableStore
from tests.conftest import CACHE_DIR, TEST_EXECUTABLES

BITCLASSES = CACHE_DIR / "bitclasses.json"  # as a start records them (runtime.assembly.compose)


def small_plan(lengths=(16, 32), batches=(1, 8), prefix_sharing=False, suffix_lengths=(8,), suffix_batches=(4,),
               labels=(4, 16), max_tokens=4096, contexts=None, completion_batches=(), label_tokens=8) -> BucketPlan:
    return BucketPlan(lengths=tuple(lengths), max_tokens=max_tokens, labels=tuple(labels),
                      context_lengths=tuple(contexts or lengths), prefix_sharing=prefix_sharing,
                      layout=GridLayout(tuple(batches), tuple(suffix_lengths), tuple(suffix_batches)),
                      completion_batches=tuple(completion_batches), label_tokens=label_tokens)


def platform_kernels(model_dir: Path, dtype: str, layout: str = "grid") -> Kernels:
    """The kernels the CPU platform runs this model with in `dtype` (runtime.assembly.platform): batch invariance on
    the grid (it yields to packed rows), sized by this host's matmul bit classes."""
    cfg = load_config(model_dir)
    platform = resolve(load_settings(environ={}, dtype=dtype, bucket_layout=layout), backend="cpu")
    return fit_to_matmuls(platform, array_shapes(cfg), cfg.head_dim, False, BITCLASSES).kernels


def scorer_for(model_dir: Path, dtype: str = "float32", plan: BucketPlan | None = None, lazy: bool = True,
               kernels: Kernels | None = None, concurrent_batches: int | None = None) -> Scorer:
    """A scorer as the CPU platform runs it (platform_kernels, its device batches at once), or with the given
    kernels."""
    cfg = load_config(model_dir)
    plan = plan or small_plan()
    kernels = kernels or platform_kernels(model_dir, dtype, plan.layout.name)
    model = Transformer(cfg, load_arrays(model_dir, cfg), dtype, kernels, plan.max_length, plan.label_tokens)
    return Scorer(plan, stored_executables(model, lazy), concurrent_batches or cpu_threads())


def stored_executables(model: Transformer, lazy: bool = True) -> Executables:
    """The model's programs, loaded from the tests' executable store when an earlier run compiled them (no tracing,
    lowering or compiling), else compiled and stored there (runtime.assembly.store's fingerprint: a change of the
    runtime's source, a flag or jaxlib is a new set)."""
    return Executables(model, lazy=lazy, store=ExecutableStore(TEST_EXECUTABLES))



def assert_whole_sequence_bits_after_a_prefix(shared: Scorer, full: Scorer, sequences, labels) -> None:
    """Items scored after their shared prefix (the cascade, which must run) have the bits of their whole sequence
    scored alone (batch-invariant kernels)."""
    before = shared.prefix_batches
    together = shared.score(sequences, labels)
    assert shared.prefix_batches > before  # the cascade ran
    for sequence, scores in zip(sequences, together):
        assert np.array_equal(scores, full.score([sequence], labels)[0])

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)

# /proc/cpuinfo of the hosts scorefn runs on (flags cut to the ones that matter and a few others)
SAPPHIRE_RAPIDS = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                   "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n"
                   "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu\n")
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
GRAVITON = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve bf16\n"

# family -> (config class, model class), as transformers names them
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "llama_cls": ("LlamaConfig", "LlamaForSequenceClassification"),
    "qwen2_cls": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "qwen3_cls": ("Qwen3Config", "Qwen3ForSequenceClassification"),
    "gemma_cls": ("GemmaConfig", "GemmaForSequenceClassification"),
    "gemma2_cls": ("Gemma2Config", "Gemma2ForSequenceClassification"),
    "gemma3_cls": ("Gemma3TextConfig", "Gemma3TextForSequenceClassification"),
    "phi3_cls": ("Phi3Config", "Phi3ForSequenceClassification"),
}


# The parameters tiny_checkpoint moves off their initial values, by family (default: the norms)
NOISY = {"gpt_oss": ("norm", "bias", "sinks")}


def tiny_checkpoint(family: str, out_dir: Path, **overrides):
    """A random transformers model of `family`, saved as a Hugging Face directory; returns the torch model."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1 (gpt-oss: biases away from their 0), so a misplaced one shows
        for name, param in model.named_parameters():
            if any(part in name for part in NOISY.get(family, ("norm",))):
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def tiny_served(family: str, out_dir: Path, embedded_dir: Path, **overrides):
    """tiny_checkpoint with SmolLM2's vocabulary and tokenizer files: the engine starts on it as on the embedded model
    (the built-in classifier and reranker find their one-token words and the chat template they prompt with), at a
    fraction of the cost to load and run."""
    model = tiny_checkpoint(family, out_dir, **{"vocab_size": 49152, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_dir / name, out_dir / name)
    return model


def random_sequences(rng: np.random.Generator, count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    """The embedded model's tokenizer."""
    from runtime.model.loader import load_tokenizer

    return load_tokenizer(embedded_dir)


# Tiny random configs of every supported architecture and RoPE type: case -> (family, config overrides).
# Length-dependent RoPE (dynamic, longrope) switches at 24 tokens, inside the served 32.
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
             "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}
CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope_scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16},
                                      "rope_theta": 500000.0}),
    "smollm2_like": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1, "rope_theta": 100000.0}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3_moe_linear_rope": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                            "moe_intermediate_size": 32,
                                            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Mixtral: top-2 renormalized, experts intermediate_size wide, a sliding window; OLMoE: q/k norms over all heads,
    # its top-k not renormalized
    "mixtral_sliding_window": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding and full layers, top-k of the router's logits then softmax,
    # biased experts with the clamped SwiGLU; yarn RoPE (its default, here over a shorter original length)
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                            "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.5,
                            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                "original_max_position_embeddings": 16}}),
    "gemma": ("gemma", {"attention_bias": True}),
    # soft-caps small enough to bend the scores; layer 0 slides (window 6), layer 1 is global
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                          "query_pre_attn_scalar": 24}),
    "gemma3_local_global_rope": ("gemma3", {
        "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 3.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "phi3_longrope_partial_sliding": ("phi3", {"sliding_window": 10, "partial_rotary_factor": 0.75,
                                               "max_position_embeddings": 96, "original_max_position_embeddings": 24,
                                               "rope_scaling": _LONGROPE, "pad_token_id": 0}),
    "granite_dynamic_rope": ("granite", {"embedding_multiplier": 3.0, "attention_multiplier": 0.2,
                                         "residual_multiplier": 0.5, "logits_scaling": 2.0,
                                         "max_position_embeddings": 24,
                                         "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "olmo2_yarn_rope": ("olmo2", {"max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
}
# One plan for every path (full sequences, a shared prefix as a cascade, per-position log-probabilities), one bucket
# of each kind: six executables per case. Bucket choice and splitting are tested elsewhere (test_batching).
PARITY_PLAN = small_plan(lengths=(64,), batches=(8,), labels=(16,), prefix_sharing=True, suffix_lengths=(8,),
                         suffix_batches=(4,), completion_batches=(4,))


class FreshRope:
    """Calls a transformers model as a fresh one: its dynamic RoPE keeps the frequencies of the longest sequence
    seen (until one is short again), so a 30-token sequence after a 32-token one would be computed with the
    32-token frequencies. scorefn computes each row from its own length, which is transformers on that sequence
    alone."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        for module in self.model.modules():
            if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
                module.inv_freq = module.original_inv_freq.clone()
                module.max_seq_len_cached = module.original_max_seq_len
        return self.model(*args, **kwargs)


@pytest.fixture(scope="session")
def tiny_case(request, tmp_path_factory):
    """(PyTorch reference, float32 scorer on PARITY_PLAN) for CASES[request.param] (parametrize indirectly):
    pytest groups the tests of one case, so every path's parity test shares one checkpoint and one set of
    compiled buckets."""
    family, overrides = CASES[request.param]
    model_dir = tmp_path_factory.mktemp(request.param)
    torch_model = tiny_checkpoint(family, model_dir, **overrides)
    return FreshRope(torch_model), scorer_for(model_dir, "float32", PARITY_PLAN)
