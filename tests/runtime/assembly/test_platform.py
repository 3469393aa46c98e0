"""runtime.assembly.platform: the per-backend defaults, explicit settings winning, and cuDNN attention only where it
runs."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from runtime.model.config import config_from_hf
from runtime.shapes.grid import GridLayout
from runtime.shapes.packed import PackedLayout
from runtime.assembly import platform as platforms
from runtime.assembly.platform import (BF16_MATMUL_CLASSES, CPU_CLASS_NAMES, CPU_FORMATS, CpuFormat, HostCpu,
                                       classes_below, compile_class, cpu_format, host_cpu, matmul_probe, resolve)
from runtime.assembly.attention_fit import fit_to_layout, fit_to_model
from runtime.settings import load_settings
from tests.runtime.conftest import EPYC, GRAVITON, SAPPHIRE_RAPIDS

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def test_the_host_cpu_and_its_feature_class():
    xeon = host_cpu(SAPPHIRE_RAPIDS)
    assert xeon.model == "Intel(R) Xeon(R) Processor" and xeon.feature_class == "amx"
    assert xeon.describe() == ("Intel(R) Xeon(R) Processor, feature class amx (amx_bf16 amx_tile avx2 avx512_bf16 "
                               "avx512f fma)")
    assert host_cpu(EPYC).feature_class == "avx2"
    assert host_cpu(GRAVITON).feature_class == "baseline" and host_cpu(GRAVITON).model == "unknown CPU"
    assert HostCpu("x", frozenset({"avx512f", "avx512_bf16"})).feature_class == "avx512_bf16"
    assert HostCpu("x", frozenset({"avx512f"})).feature_class == "avx512"
    assert host_cpu("").describe() == "unknown CPU, feature class baseline (none of avx2)"
    assert host_cpu(EPYC).runs("avx2") and host_cpu(EPYC).runs("baseline") and not host_cpu(EPYC).runs("avx512")


def test_an_unreadable_cpuinfo_is_an_unknown_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(platforms, "CPUINFO", tmp_path / "missing")
    assert host_cpu() == HostCpu("unknown CPU", frozenset())


def test_the_cpu_format_is_the_classes_in_a_fixed_table():
    """Decided by the class alone (a timing at start flipped the format between starts on a Zen 4 host), with the
    measurement behind each entry; SCOREFN_DTYPE wins; a table is injectable."""
    assert cpu_format("amx") == CpuFormat("amx", "bfloat16", CPU_FORMATS["amx"][1])
    assert cpu_format("avx512_bf16").dtype == "bfloat16" and "Zen 4, 2026-11-26" in cpu_format("avx512_bf16").reason
    for feature_class in ("avx512", "avx2", "baseline"):
        assert cpu_format(feature_class).dtype == "float32"
    assert set(CPU_FORMATS) == set(CPU_CLASS_NAMES) and BF16_MATMUL_CLASSES == ("amx", "avx512_bf16")
    assert cpu_format("avx512_bf16", dtype="float32") == CpuFormat("avx512_bf16", "float32", "SCOREFN_DTYPE")
    assert cpu_format("avx2", formats={"avx2": ("bfloat16", "injected")}) == CpuFormat("avx2", "bfloat16", "injected")


def test_the_matmul_probe_measures_both_formats():
    figures = matmul_probe(rows=8, width=32, inner=64, repeats=3)
    assert set(figures) == {"float32", "bfloat16"} and min(figures.values()) > 0


def test_the_class_compiled_for_is_the_hosts_or_the_xla_cap_below_it():
    xeon, epyc = host_cpu(SAPPHIRE_RAPIDS), host_cpu(EPYC)
    assert compile_class(xeon, "") == "amx" and compile_class(epyc, "--xla_foo=1") == "avx2"
    assert compile_class(xeon, "--xla_foo=1 --xla_cpu_max_isa=AVX2") == "avx2"
    assert compile_class(xeon, "--xla_cpu_max_isa=avx") == "baseline"
    assert compile_class(epyc, "--xla_cpu_max_isa=AMX") == "avx2"  # a cap above the host changes nothing
    assert classes_below("avx2") == ("baseline",) and classes_below("baseline") == ()
    assert classes_below("amx") == ("avx512_bf16", "avx512", "avx2", "baseline")
    assert platforms.max_isa_flag("avx2") == "--xla_cpu_max_isa=AVX2"


def test_the_cpu_dtype_is_the_formats_unless_set():
    amx = CpuFormat("amx", "bfloat16", "AMX")
    platform = resolve(load_settings(environ={}), backend="cpu", cpu=amx)
    assert platform.dtype == "bfloat16" and not platform.kernels.unroll and platform.cpu == amx
    assert platform.describe().startswith("cpu: bfloat16 (CPU class amx: AMX), batch-invariant on (matmuls of at "
                                          "least 64 rows)")
    pinned = resolve(load_settings(environ={"SCOREFN_DTYPE": "float32"}), backend="cpu", cpu=amx)
    assert pinned.dtype == "float32" and pinned.cpu == CpuFormat("amx", "float32", "SCOREFN_DTYPE")
    assert resolve(load_settings(environ={}), backend="gpu", cpu=amx).cpu is None


def test_cpu_defaults():
    platform = resolve(load_settings(environ={}), backend="cpu", cpu=cpu_format("avx2"))
    assert platform.dtype == "float32"
    assert platform.kernels.attention == "xla" and platform.kernels.attention_dtype == "float32"
    assert not platform.kernels.unroll and platform.kernels.matmul_precision is None
    assert platform.layout == GridLayout((1, 2, 4, 8, 16, 32), (8, 12, 16, 24, 32, 48, 64, 128), (1, 4, 16))
    assert platform.max_bucket_tokens == 16384
    assert platform.kernels.batch_invariant


def test_batch_invariance_is_on_by_default_on_a_cpu_only():
    def invariant(backend, **environ):
        return resolve(load_settings(environ=environ), backend=backend).kernels.batch_invariant
    assert invariant("cpu") and not invariant("gpu") and not invariant("tpu")
    assert not invariant("cpu", SCOREFN_BATCH_INVARIANT="false") and invariant("gpu", SCOREFN_BATCH_INVARIANT="true")
    gpu = resolve(load_settings(environ={"SCOREFN_BATCH_INVARIANT": "true"}), backend="gpu")
    assert gpu.kernels.attention == "pallas" and isinstance(gpu.layout, GridLayout)  # what the invariant kernels run
    tpu = resolve(load_settings(environ={"SCOREFN_BATCH_INVARIANT": "true"}), backend="tpu")
    assert tpu.kernels.attention == "pallas_tpu" and isinstance(tpu.layout, GridLayout)  # Mosaic's kernel
    explicit = resolve(load_settings(environ={"SCOREFN_BATCH_INVARIANT": "true", "SCOREFN_ATTENTION": "pallas"}),
                       backend="tpu")
    assert explicit.kernels.attention == "pallas_tpu"  # the setting names Pallas; the platform picks its backend
    assert not invariant("cpu", SCOREFN_ATTENTION="cudnn")  # auto yields to an explicit choice it cannot run


def test_attention_computes_in_the_format_but_xla_on_a_gpu():
    """bfloat16 Q/K/V with the bfloat16 format on a CPU (within the exactness rule: tests/runtime/model/
    test_parity_embedded.py); float32 with XLA on a GPU, the exact choice beside cuDNN."""
    kernels = resolve(load_settings(environ={"SCOREFN_DTYPE": "bfloat16"}), backend="cpu").kernels
    assert not kernels.unroll and kernels.attention_dtype == "bfloat16"
    assert resolve(load_settings(environ={"SCOREFN_DTYPE": "float32"}), backend="cpu").kernels.attention_dtype == \
        "float32"
    gpu = resolve(load_settings(environ={"SCOREFN_ATTENTION": "xla"}), backend="gpu").kernels
    assert gpu.attention_dtype == "float32"


@pytest.mark.parametrize("backend,attention", [("gpu", "cudnn"), ("tpu", "xla")])
def test_accelerator_defaults(backend, attention):
    platform = resolve(load_settings(environ={}), backend=backend)
    assert platform.dtype == "bfloat16" and not platform.kernels.unroll
    assert platform.kernels.attention == attention and platform.kernels.attention_dtype == "bfloat16"
    assert platform.kernels.matmul_precision == "highest"  # float32 matmuls (the head) are not TF32
    assert isinstance(platform.layout, PackedLayout) and platform.label_buckets == (16, 1024)  # two label buckets


def test_the_cpu_keeps_the_grid_and_either_layout_can_be_chosen():
    assert resolve(load_settings(environ={}), backend="cpu").layout.name == "grid"
    assert resolve(load_settings(environ={"SCOREFN_BUCKET_LAYOUT": "packed"}), backend="cpu").layout.name == "packed"
    with pytest.raises(ValueError, match="SCOREFN_BATCH_INVARIANT=true needs"):  # packed rows are not invariant
        resolve(load_settings(environ={"SCOREFN_BUCKET_LAYOUT": "packed", "SCOREFN_BATCH_INVARIANT": "true"}),
                backend="cpu")
    grid = resolve(load_settings(environ={"SCOREFN_BUCKET_LAYOUT": "grid"}), backend="tpu").layout
    assert grid.batches[-1] == 256 and grid.suffix_batches[-1] == 512  # the accelerators' grid buckets
    short = resolve(load_settings(environ={"SCOREFN_LENGTH_BUCKETS": "16,64"}), backend="gpu").layout
    assert short.width == 64 and max(short.narrow) < 64  # rows no wider than the longest sequence


def test_cudnn_falls_back_to_xla_on_a_mesh_that_splits_query_heads_but_not_kv_heads(caplog):
    import types


    platform = resolve(load_settings(environ={}), backend="gpu")
    split_alike = types.SimpleNamespace(model=2, parts={"attention": True, "kv": True})
    assert fit_to_layout(platform, split_alike, explicit=False) is platform
    kv_replicated = types.SimpleNamespace(model=4, parts={"attention": True, "kv": False})
    assert fit_to_layout(platform, kv_replicated, explicit=False).kernels.attention == "xla"
    assert "split alike" in caplog.text
    with pytest.raises(ValueError, match="SCOREFN_ATTENTION=cudnn cannot run this model on this mesh"):
        fit_to_layout(platform, kv_replicated, explicit=True)


def test_float32_on_a_gpu_is_float32():
    platform = resolve(load_settings(environ={"SCOREFN_DTYPE": "float32"}), backend="gpu")
    assert platform.kernels.attention == "xla" and platform.kernels.attention_dtype == "float32"
    assert platform.kernels.matmul_precision == "highest"


def test_explicit_settings_win():
    settings = load_settings(environ={"SCOREFN_LAYER_LOOP": "unroll", "SCOREFN_ATTENTION": "xla",
                                      "SCOREFN_BATCH_BUCKETS": "2,4", "SCOREFN_SUFFIX_BATCH_BUCKETS": "16",
                                      "SCOREFN_MAX_BUCKET_TOKENS": "999"})
    platform = resolve(settings.replace(bucket_layout="grid"), backend="gpu")
    assert platform.kernels.unroll and platform.kernels.attention == "xla"
    layout = platform.layout
    assert (layout.batches, layout.suffix_batches, platform.max_bucket_tokens) == ((2, 4), (16,), 999)


def test_auto_buckets_round_up_to_the_data_axis_explicit_ones_stay():
    settings = load_settings(environ={"SCOREFN_SUFFIX_BATCH_BUCKETS": "6"})
    platform = resolve(settings, backend="gpu", data=4)
    assert platform.completion_batch_buckets == (4, 16)
    assert platform.layout.rows == (4, 16, 64) and platform.layout.slots == (4, 16, 64, 256, 1024)
    assert platform.layout.narrow_widths(False) == ()  # a sharded batch has a row per device at least
    grid = resolve(settings.replace(bucket_layout="grid"), backend="gpu", data=4).layout
    assert grid.batches == (4, 8, 16, 32, 64, 128, 256)
    assert grid.suffix_batches == (6,)  # as set: the mesh check names it
    assert resolve(settings, backend="gpu", data=1) == resolve(settings, backend="gpu")


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="SCOREFN_ATTENTION='flash' is invalid"):
        load_settings(environ={"SCOREFN_ATTENTION": "flash"})
    with pytest.raises(ValueError, match="SCOREFN_DTYPE='float16' is invalid"):
        load_settings(environ={"SCOREFN_DTYPE": "float16"})


def test_xla_attention_on_a_gpu_keeps_float32_attention():
    kernels = resolve(load_settings(environ={"SCOREFN_ATTENTION": "xla"}), backend="gpu").kernels
    assert kernels.attention == "xla" and kernels.attention_dtype == "float32"


def test_cudnn_falls_back_to_xla_where_it_cannot_run(caplog):
    """On this CPU the start-up probe cannot run cuDNN: auto falls back with a warning, explicit cudnn fails."""
    cfg = config_from_hf(QWEN3)
    gpu = resolve(load_settings(environ={}), backend="gpu")
    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        kernels = fit_to_model(gpu, cfg, 2048, explicit=False).kernels
    assert kernels.attention == "xla" and kernels.attention_dtype == "float32"
    assert "attention falls back to XLA: cuDNN attention did not run" in caplog.text
    with pytest.raises(ValueError, match="SCOREFN_ATTENTION=cudnn cannot run this model"):
        fit_to_model(gpu, cfg, 2048, explicit=True)


@pytest.mark.parametrize("change,reason", [
    ({"head_dim": 12}, "multiples of 8 up to 128, this model's is 12"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 512}, "sliding window of 512 tokens"),
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096},
     "Gemma2ForCausalLM soft-caps its attention scores (tanh, cap 50), which cuDNN attention cannot compute"),
    ({"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512}, "sliding window of 512 tokens"),
])
def test_cudnn_is_not_tried_where_it_cannot_apply(change, reason, caplog):
    cfg = config_from_hf({**QWEN3, **change})
    gpu = resolve(load_settings(environ={}), backend="gpu")
    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        assert fit_to_model(gpu, cfg, 2048, explicit=False).kernels.attention == "xla"
    assert reason in caplog.text
    with pytest.raises(ValueError, match=f"SCOREFN_ATTENTION=cudnn cannot run this model: .*{re.escape(reason)}"):
        fit_to_model(gpu, cfg, 2048, explicit=True)  # SCOREFN_ATTENTION=cudnn: the start fails, saying why


@pytest.mark.parametrize("backend,attention", [("gpu", "cudnn"), ("gpu", "pallas"), ("tpu", "pallas")])
def test_attention_sinks_run_on_xla_attention(backend, attention, caplog):
    """gpt-oss's sinks: neither cuDNN nor the Pallas kernels take them; auto falls back, an explicit choice fails."""
    cfg = config_from_hf({**QWEN3, "architectures": ["GptOssForCausalLM"], "num_local_experts": 4,
                          "num_experts_per_tok": 2, "head_dim": 64})
    assert cfg.attention_sinks
    environ = {} if attention == "cudnn" else {"SCOREFN_BATCH_INVARIANT": "true"}
    platform = resolve(load_settings(environ=environ), backend=backend)
    assert platform.kernels.attention.startswith(attention)
    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        assert fit_to_model(platform, cfg, 2048, explicit=False, probe=False).kernels.attention == "xla"
    assert "GptOssForCausalLM has attention sinks" in caplog.text
    with pytest.raises(ValueError, match=f"SCOREFN_ATTENTION={attention} cannot run this model: .*attention sinks"):
        fit_to_model(platform, cfg, 2048, explicit=True, probe=False)


def test_a_cpu_runs_its_launcher_threads_batches_at_once_an_accelerator_or_a_mesh_one():
    import types

    from runtime.requests.launch import cpu_threads

    cpu = resolve(load_settings(environ={}), backend="cpu")
    assert cpu.concurrent_batches == cpu_threads()
    assert f"{cpu.concurrent_batches} batch(es) at once" in cpu.describe()
    assert resolve(load_settings(environ={}), backend="gpu").concurrent_batches == 1
    data_mesh = types.SimpleNamespace(model=1, parts={"attention": False, "kv": False})
    two = dataclasses.replace(cpu, concurrent_batches=2)
    assert fit_to_layout(two, data_mesh, explicit=False).concurrent_batches == 1
