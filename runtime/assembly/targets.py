"""Compile targets as data: the devices scorefn serves on, and how to get compile-only stand-ins for them on a CPU
host (deviceless ahead-of-time compilation, `scorefn compile --target NAME`).

A target name is `NAME` or `NAME:COUNT`: `h100:4` is four H100s on one host (SCOREFN_MESH then splits them),
`tpu-v5e:2x2` a 2x2 v5e slice. The backend decides the platform choices (runtime.assembly.platform.resolve), so a
start on the real device and a compile for its target build the same programs.

Device figures are vendor datasheet numbers (dense bfloat16 peak, i.e. without 2:4 sparsity), used for the
out-of-memory check at build time and for `scorefn bench --roofline`, which reports upper bounds:
- NVIDIA L4: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s bf16 (242 sparse); 58 SMs, compute capability 8.9
  (NVIDIA L4 Tensor Core GPU datasheet; Ada: 100 KB shared memory and 1,536 threads per SM).
- NVIDIA H100 SXM5 80GB: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16; 132 SMs, compute capability 9.0
  (NVIDIA H100 Tensor Core GPU datasheet; Hopper tuning guide: 228 KB shared memory per SM).
- NVIDIA A100 SXM4 80GB: 80 GB HBM2e, 2,039 GB/s, 312 TFLOP/s bf16; 108 SMs, compute capability 8.0
  (NVIDIA A100 datasheet; Ampere tuning guide: 164 KB shared memory per SM).
- TPU v5e: 16 GB HBM2 and 819 GB/s per chip, 197 TFLOP/s bf16 (Google Cloud TPU v5e documentation).
- TPU v6e (Trillium): 32 GB HBM and 1,640 GB/s per chip, 918 TFLOP/s bf16 (Google Cloud TPU v6e documentation).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from typing import Any

GB = 10**9


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device model: what the compiler needs to stand in for it, and its datasheet figures."""
    backend: str  # cpu | gpu | tpu
    device_kind: str  # what a real device reports (jax.Device.device_kind)
    memory_bytes: int | None  # per device
    peak_bf16_flops: float | None  # per device, dense
    memory_bandwidth: float | None  # bytes/s per device
    tpu_generation: str = ""  # topology prefix: v5e, v6e
    gpu: dict[str, Any] | None = None  # GpuTargetConfigProto's gpu_device_info fields


_GPU_COMMON = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                   fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
                   block_dim_limit_z=65535, registers_per_core_limit=65536, registers_per_block_limit=65536)

CHIPS: dict[str, Chip] = {
    "cpu": Chip("cpu", "cpu", None, None, None),
    "l4": Chip("gpu", "NVIDIA L4", 24 * GB, 121e12, 300 * GB, gpu=dict(
        _GPU_COMMON, core_count=58, shared_memory_per_core=102400, shared_memory_per_block_optin=101376,
        threads_per_core_limit=1536, clock_rate_ghz=2.04, l2_cache_size=48 * 2**20, cc=(8, 9))),
    "h100": Chip("gpu", "NVIDIA H100 80GB HBM3", 80 * GB, 989e12, 3350 * GB, gpu=dict(
        _GPU_COMMON, core_count=132, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
        threads_per_core_limit=2048, clock_rate_ghz=1.98, l2_cache_size=50 * 2**20, cc=(9, 0))),
    "a100": Chip("gpu", "NVIDIA A100-SXM4-80GB", 80 * GB, 312e12, 2039 * GB, gpu=dict(
        _GPU_COMMON, core_count=108, shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
        threads_per_core_limit=2048, clock_rate_ghz=1.41, l2_cache_size=40 * 2**20, cc=(8, 0))),
    "tpu-v5e": Chip("tpu", "TPU v5 lite", 16 * GB, 197e12, 819 * GB, tpu_generation="v5e"),
    "tpu-v6e": Chip("tpu", "TPU v6 lite", 32 * GB, 918e12, 1640 * GB, tpu_generation="v6e"),
}


class TargetError(ValueError):
    """A target name that names no known device, or a count it cannot have."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given, e.g. tpu-v5e:2x2
    chip: Chip
    shape: tuple[int, ...]  # TPU topology (2, 2) or (GPU count,)

    @property
    def backend(self) -> str:
        return self.chip.backend

    @property
    def device_count(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count

    def devices(self) -> list[Any]:
        """Compile-only devices of this target (the real CPU devices for `cpu`)."""
        # JAX imported here, not with this module: `scorefn compile` and `bench --roofline` parse a target's name
        # and set JAX_PLATFORMS=cpu before JAX is imported (runtime.tools.cli).
        import jax
        from jax.experimental import topologies

        if self.backend == "cpu":
            return jax.devices("cpu")[: self.device_count]
        if self.backend == "tpu":
            # Compile-only: no chip to guard, so several processes may load libtpu at once (its lockfile would
            # refuse a second compiling process on the build host).
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            # libtpu 0.0.42 assumes a host of 2x2 chips unless told: one host holds the whole slice here.
            topology = f"{self.chip.tpu_generation}:{'x'.join(map(str, self.shape))}"
            bounds = (*self.shape, 1) if len(self.shape) == 2 else self.shape
            return list(topologies.get_topology_desc(topology, platform="tpu", chips_per_host_bounds=bounds).devices)
        return list(topologies.get_topology_desc("", platform="cuda", target_config=self.gpu_target_config(),
                                                 topology=f"1x1x{self.device_count}").devices)

    def gpu_target_config(self) -> str:
        """The GpuTargetConfigProto text XLA compiles against in place of a device. The CUDA runtime and cuDNN
        versions are those installed beside the compiler (in the image: the ones the service runs with)."""
        info = dict(self.chip.gpu or {})
        major, minor = info.pop("cc")
        fields = " ".join(f"{key}: {value}" for key, value in info.items())
        runtime = _version_parts("nvidia-cuda-runtime-cu12") or _version_parts("nvidia-cuda-nvcc-cu12") or (12, 9, 0)
        dnn = _version_parts("nvidia-cudnn-cu12") or (9, 8, 0)
        return (f"gpu_device_info {{ {fields} memory_bandwidth: {int(self.chip.memory_bandwidth)} "
                f"device_memory_size: {self.chip.memory_bytes} "
                f"cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
                f"runtime_version {{ major: {runtime[0]} minor: {runtime[1]} patch: {runtime[2]} }} "
                f'platform_name: "CUDA" dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} }} '
                f'device_description_str: "{self.chip.device_kind}"')

    def usable_memory(self) -> int | None:
        """Bytes one device may hold for the runtime: on a GPU JAX takes XLA_PYTHON_CLIENT_MEM_FRACTION of it
        (0.75 by default) unless preallocation is off."""
        if self.chip.memory_bytes is None:
            return None
        if self.backend != "gpu" or os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false":
            return self.chip.memory_bytes
        return int(self.chip.memory_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))

    def describe(self) -> str:
        return f"{self.name} ({self.device_count} x {self.chip.device_kind}, backend {self.backend})"


def _version_parts(package: str) -> tuple[int, int, int] | None:
    try:
        numbers = [int(part) for part in re.findall(r"\d+", importlib.metadata.version(package))[:3]]
    except importlib.metadata.PackageNotFoundError:
        return None
    return (*numbers, 0, 0, 0)[:3]  # type: ignore[return-value]


def parse_target(text: str) -> Target:
    """`NAME` or `NAME:COUNT` (GPU, CPU: a device count; TPU: a topology such as 2x2) -> Target."""
    name, _, count = text.strip().lower().partition(":")
    chip = CHIPS.get(name)
    if chip is None:
        raise TargetError(f"unknown target {text!r}; known: {', '.join(sorted(CHIPS))} "
                          f"(with a count: h100:4, tpu-v5e:2x2)")
    pattern, default = (r"\d+(x\d+){1,2}", "1x1") if chip.backend == "tpu" else (r"\d+", "1")
    count = count or default
    if not re.fullmatch(pattern, count) or min(int(n) for n in count.split("x")) < 1:
        raise TargetError(f"target {text!r}: the count after ':' must be "
                          f"{'a topology such as 2x2' if chip.backend == 'tpu' else 'a number of devices'}")
    return Target(f"{name}:{count}" if count != default else name, chip, tuple(int(n) for n in count.split("x")))


def library_versions(backend: str) -> dict[str, str]:
    """The packages whose build an executable for `backend` is tied to (beyond jax, jaxlib and flax)."""
    packages = {"gpu": ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu12", "nvidia-cuda-nvcc-cu12"),
                "tpu": ("libtpu",)}.get(backend, ())
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "absent"
    return versions
