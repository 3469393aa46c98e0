"""Fixtures shared by every test package: the embedded model directory, the PyTorch reference and PEFT adapters."""

from __future__ import annotations

import ast
import copy
import json
import os
import warnings
import sys
from pathlib import Path

import pytest

from runtime.settings import default_cache_dir

pytest_plugins = ["tests.compile_report"]  # XLA compile seconds by module, after the slowest tests

REPO = Path(__file__).resolve().parent.parent
# Same default as the Makefile's and the runtime's (user-level), so tests reuse the converted model and the caches.
CACHE_DIR = Path(os.environ.setdefault("SCOREFN_CACHE_DIR", default_cache_dir()))
# Engines and servers the tests start are ready once every bucket is compiled, as the tests that count compiles and
# time requests assume; tests/runtime/assembly/test_ready_first.py (and the serve-only check, outside pytest) start
# the way a first `make serve` does: ready after the first buckets, the rest compiled after ready.
os.environ.setdefault("SCOREFN_READY", "all")
# Under pytest-xdist (make test) each worker shares the cores with another, and PyTorch's OpenMP threads, one per
# core, spin while the other worker's XLA threads hold them: a 20 s fixture of transformers' models took 330 s.
# One thread each, set before anything imports PyTorch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Servers the tests start run from the serve-only venv when `make test` has made it (scripts/serve_check.py ran
# there): what `make serve` installs, and without the test extras' PyTorch for transformers to import.
SERVE_ONLY = REPO / ".venv-serve" / "bin" / "scorefn"
if SERVE_ONLY.is_file():
    os.environ.setdefault("SCOREFN_SERVE_EXECUTABLE", str(SERVE_ONLY))


# One JAX persistent compilation cache for the programs the tests compile in this process (scorers built by the
# tests), and one executable store they load them from without tracing (tests/runtime/conftest.py): a program
# several tests build compiles once, in the first run on this machine. Both user-level, as the serving caches, keyed
# as those are. Engines and servers point JAX at their own cache (SCOREFN_COMPILE_CACHE_DIR, often a test's temporary
# one); every test starts with this one again.
TEST_COMPILE_CACHE = CACHE_DIR / "test-xla"
TEST_EXECUTABLES = CACHE_DIR / "test-executables"


# The longest modules (the seconds by module tests/compile_report.py prints, a fresh clone on 2 cores), first:
# `make test` hands whole modules to its workers (pytest-xdist, --dist loadfile) in collection order, and a long
# module taken last leaves the other worker idle at the end. Only the order depends on this list: a stale one costs
# minutes, never a result.
LONGEST_FIRST = (
    "tests/runtime/model/test_invariance.py", "tests/runtime/assembly/test_sharding.py",
    "tests/runtime/model/test_lora.py", "tests/runtime/assembly/test_warmup.py", "tests/e2e/test_batch.py",
    "tests/aot/test_deviceless.py", "tests/runtime/tools/test_bench.py", "tests/runtime/model/test_parity_tiny.py",
    "tests/e2e/test_batch_invariance.py", "tests/runtime/model/test_parity_embedded.py",
    "tests/runtime/model/test_token_logprobs.py", "tests/runtime/tasks/test_rerank_models.py",
    "tests/runtime/tasks/test_classify_models.py", "tests/e2e/test_schema_fuzz.py", "tests/e2e/test_lora_http.py",
    "tests/e2e/test_lm_eval.py", "tests/e2e/test_prefix_cache_soak.py", "tests/e2e/test_failed_start.py",
    "tests/runtime/model/test_label_tokens.py", "tests/e2e/test_http.py",
    "tests/runtime/model/test_pallas_attention.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _shared_compile_cache():
    from runtime.assembly.store import enable_persistent_cache

    enable_persistent_cache(TEST_COMPILE_CACHE)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return CACHE_DIR


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from runtime.model.loader import resolve_model_dir

    model_dir, _ = resolve_model_dir("", CACHE_DIR)
    return model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, embedded_dir):
    """A tiny random Llama with SmolLM2's tokenizer: engines and servers start on it as on the embedded model, for
    tests of the machinery (compiles, the store, batching, processes) rather than of the model's numbers."""
    from tests.runtime.conftest import tiny_served

    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_served("llama", directory, embedded_dir, tie_word_embeddings=True)
    return directory


@pytest.fixture(scope="session")
def embedded_shaped_dir(tmp_path_factory, embedded_dir):
    """A random Llama of the embedded model's config, its widths, heads, vocabulary and tokenizer, but 2 layers of its
    30: every layer runs one compiled body (the layers are scanned), so its matmuls, norms and attention are the
    embedded model's kernels, at a fifteenth of the compute. For tests of the kernels' bits and of batching at the
    real shapes; the real weights' numbers are judged against transformers (test_parity_embedded.py)."""
    from tests.runtime.conftest import tiny_served

    config = json.loads((embedded_dir / "config.json").read_text())
    shape = {key: config[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                          "max_position_embeddings", "tie_word_embeddings")}
    directory = tmp_path_factory.mktemp("embedded-shaped")
    tiny_served("llama", directory, embedded_dir, **shape, num_hidden_layers=2, initializer_range=0.02)
    return directory


@pytest.fixture(scope="session")
def torch_embedded():
    """transformers' PyTorch model loaded from the same GGUF file, float32 (the reference)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.model.gguf import embedded_gguf

    gguf = embedded_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return FlushingDenormals(model.eval()), tokenizer


@pytest.fixture(scope="session")
def torch_embedded_bfloat16():
    """transformers' model from the same GGUF file in bfloat16, as a user loads it: the baseline of the bfloat16
    exactness rule (assert_bfloat16_within_baseline)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from runtime.model.gguf import embedded_gguf

    gguf = embedded_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    return FlushingDenormals(model.eval())


def error_figures(ours, reference) -> tuple[float, float, float]:
    """Mean, p99 and max of |ours - reference|."""
    import numpy as np

    error = np.abs(np.asarray(ours, np.float64) - reference)
    return float(error.mean()), float(np.percentile(error, 99)), float(error.max())


def assert_bfloat16_within_baseline(ours, baseline, reference, note: str = "", max_margin: float = 1.0) -> None:
    """The bfloat16 exactness rule: scorefn's error against transformers float32 (`reference`) is no larger than
    transformers bfloat16's (`baseline`), on the same weights, inputs and host, measured in the same test: its mean
    and p99 at most the baseline's, its max at most `max_margin` times the baseline's (a sample's maximum is one
    outlier: where the samples are few, a margin the tests defend). The failure says both."""
    mine, theirs = error_figures(ours, reference), error_figures(baseline, reference)
    bounds = (theirs[0], theirs[1], theirs[2] * max_margin)
    assert all(m <= t for m, t in zip(mine, bounds)), (
        f"{note}: |error| mean / p99 / max: scorefn bfloat16 {mine[0]:.4f} / {mine[1]:.4f} / {mine[2]:.4f}, "
        f"transformers bfloat16 {theirs[0]:.4f} / {theirs[1]:.4f} / {theirs[2]:.4f}")


class FlushingDenormals:
    """Calls the model with denormals flushed (dequantized GGUF weights hold them: 10x slower otherwise),
    and only then: the flag is process-wide, and Hypothesis refuses to run while it is set."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        import torch

        torch.set_flush_denormal(True)
        try:
            return self.model(*args, **kwargs)
        finally:
            torch.set_flush_denormal(False)


def torch_label_logprobs(model, sequences, labels):
    """Reference: each sequence alone (no padding), log-softmax at its last position, float64 out."""
    import torch

    rows = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            rows.append(torch.log_softmax(logits, dim=-1)[labels].numpy())
    import numpy as np

    return np.stack(rows)


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages a Python file imports (absolute imports, at any depth in the file), less the
    standard library's."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names - set(sys.stdlib_module_names)


def peft_adapter(base, out_dir, seed: int, rank: int, targets: list[str], rslora: bool = False):
    """A PEFT LoRA adapter of `base` with random non-zero A and B, saved to out_dir; returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank + 1, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                        init_lora_weights=False)
    with warnings.catch_warnings():  # PEFT 0.21 reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(copy.deepcopy(base), config).eval()
    with torch.no_grad():  # PEFT's random init leaves B small: large enough updates that a wrong one shows
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out_dir)
    return model


def peft_classifier(model_dir, out_dir, seed: int, labels: int, rank: int, targets: list[str]):
    """A PEFT sequence-classification adapter (task SEQ_CLS: LoRA and its own `score` head, random and non-zero)
    of the causal LM in model_dir, saved to out_dir; returns the PEFT model (its logits are the reference)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=labels, dtype=torch.float32)
    config = LoraConfig(task_type="SEQ_CLS", r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False)
    with warnings.catch_warnings():  # PEFT 0.21 reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "score" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out_dir)
    return model
