"""Runtime test helpers: small bucket plans, tiny random Hugging Face checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.serving.buckets import BucketPlan
from runtime.model.config import load_config
from runtime.model.transformer import Kernels, Llama
from runtime.serving.platform import resolve
from runtime.serving.scorer import Scorer
from runtime.settings import load_settings
from runtime.model.weights import load_arrays


def small_plan(lengths=(16, 32), batches=(1, 8), prefix_sharing=False, suffix_lengths=(8,), suffix_batches=(4,),
               labels=(4, 16), max_tokens=4096, contexts=None, completion_batches=()) -> BucketPlan:
    return BucketPlan(lengths=tuple(lengths), batches=tuple(batches), max_tokens=max_tokens, labels=tuple(labels),
                      context_lengths=tuple(contexts or lengths), suffix_lengths=tuple(suffix_lengths),
                      suffix_batches=tuple(suffix_batches), prefix_sharing=prefix_sharing,
                      completion_batches=tuple(completion_batches))


def scorer_for(model_dir: Path, dtype: str = "float32", plan: BucketPlan | None = None, lazy: bool = True,
               kernels: Kernels | None = None) -> Scorer:
    """A scorer as the CPU platform runs it (runtime.serving.platform), or with the given kernels."""
    cfg = load_config(model_dir)
    plan = plan or small_plan()
    kernels = kernels or resolve(load_settings(environ={}, dtype=dtype), backend="cpu").kernels
    return Scorer(Llama(cfg, load_arrays(model_dir, cfg), dtype, kernels, plan.max_length), plan, lazy=lazy)


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)
# family -> (config class, model class), as transformers names them
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
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


def tiny_checkpoint(family: str, out_dir: Path, **overrides):
    """A random transformers model of `family`, saved as a Hugging Face directory; returns the torch model."""
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def random_sequences(rng: np.random.Generator, count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


@pytest.fixture(scope="session")
def tokenizer(embedded_dir):
    """The embedded model's tokenizer."""
    from runtime.model.loader import load_tokenizer

    return load_tokenizer(embedded_dir)
