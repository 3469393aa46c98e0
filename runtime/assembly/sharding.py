"""Running one model on a device mesh with JAX's own sharding: a `Mesh` with axes ("data", "model"),
a `NamedSharding` per parameter (from the logical axes of its declaration, runtime.model.params), and `jit` with
in/out shardings per entry point.

- data: every device batch is split by rows; each data slice holds a full copy of the (model-sharded) weights.
  With the batch-invariant kernels and no model axis, each device runs the single-device program on its own rows
  (`jax.shard_map`): XLA's partitioner would otherwise choose its own kernels for the split program, whose bits
  moved by float32 rounding against one device (tiny Qwen3, 2026-11-25).
- model: tensor parallel (Megatron style). Attention is split by heads (wq/bq by output columns, wo by
  input rows), the MLP by its hidden units (w_gate/w_up by columns, w_down by rows), the embedding /
  vocabulary head by vocabulary rows; XLA inserts the all-reduces. KV heads are split with the query
  heads when they divide too, and replicated otherwise. A part whose size does not divide by the model
  axis is replicated (logged); norms (pre, post, q/k), the output/down biases, the MoE router and small heads
  always are. Qwen3-MoE's experts split by their hidden units, as the MLP does.
  The layer axis of the stacked weights is never split (the layers run under `lax.scan`).

Each program's arguments and results are laid out by their roles in runtime.shapes.programs. One device (the
default on a laptop or a one-GPU machine) skips all of this: `build_mesh_layout` returns None and the runtime runs
exactly as unsharded code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from runtime.model import params
from runtime.model.config import ModelConfig
from runtime.shapes.buckets import BucketPlan
from runtime.shapes.programs import PROGRAMS

log = logging.getLogger("scorefn.runtime")

DATA, MODEL = "data", "model"


class MeshError(ValueError):
    """The mesh setting cannot run this model or bucket plan on these devices (a start-up error)."""


def parse_mesh(text: str, device_count: int) -> tuple[int, int]:
    """(data, model) from SCOREFN_MESH ("DATAxMODEL"); empty: every device on the data axis."""
    text = text.strip().lower()
    if not text:
        return device_count, 1
    match = re.fullmatch(r"(\d+)\s*x\s*(\d+)", text)
    if not match or min(int(n) for n in match.groups()) < 1:
        raise MeshError(f"SCOREFN_MESH={text!r} is not DATAxMODEL with positive integers (e.g. 4x1, 1x4, 2x2)")
    data, model = (int(n) for n in match.groups())
    if data * model > device_count:
        raise MeshError(f"SCOREFN_MESH={text} needs {data * model} devices, this host has {device_count}")
    return data, model


# ---- which parameters split along the model axis --------------------------------------------------------

# The part of the model each logical axis of a parameter's declaration (runtime.model.params) belongs to: the axis
# splits over the model axis when that part does. Every other axis (the layers, the experts, the hidden size,
# None) is never split: Qwen3-MoE's experts split by their hidden units like the MLP (every device holds every
# expert: the dense formulation runs them all), and the stacked layers run under `lax.scan`.
_PARTS = {params.HEADS: "attention", params.KV_HEADS: "kv", params.MLP: "mlp", params.VOCAB: "vocab"}


def sharded_parts(cfg: ModelConfig, model: int, data: int = 1) -> dict[str, bool]:
    """Which parts of the model split over a model axis of `model` devices (the rest is replicated)."""
    if model == 1:
        return {"attention": False, "kv": False, "mlp": False, "vocab": False}
    attention = cfg.num_heads % model == 0
    mlp_units = cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    parts = {"attention": attention, "kv": attention and cfg.num_kv_heads % model == 0,
             "mlp": mlp_units % model == 0, "vocab": cfg.vocab_size % model == 0}
    if not (parts["attention"] or parts["mlp"] or parts["vocab"]):
        raise MeshError(
            f"a model axis of {model} devices splits nothing of this model: its {cfg.num_heads} attention heads, "
            f"{mlp_units} MLP hidden units and {cfg.vocab_size}-token vocabulary are not multiples "
            f"of {model}; use a model axis that divides them, or the data axis only (SCOREFN_MESH={data * model}x1)")
    if not attention:
        divisors = [str(d) for d in range(2, cfg.num_heads + 1) if cfg.num_heads % d == 0]
        hint = f"a model axis of {' or '.join(divisors)} would split them" if divisors else "they cannot be split"
        split = " and ".join(label for part, label in (("mlp", "MLP"), ("vocab", "vocabulary")) if parts[part])
        log.warning("attention replicated on the model axis: %d query heads do not divide by %d (%s); "
                    "split over it: %s", cfg.num_heads, model, hint, split)
    elif not parts["kv"]:
        log.info("KV heads replicated on the model axis: %d KV heads do not divide by %d (query heads are split)",
                 cfg.num_kv_heads, model)
    if not parts["mlp"]:
        log.warning("MLP replicated on the model axis: %d hidden units do not divide by %d", mlp_units, model)
    return parts


def param_spec(info: params.ParamInfo | None, parts: dict[str, bool], one_layer: bool = False) -> P:
    """PartitionSpec of a parameter from its declaration's logical axes; `one_layer`: an unrolled model's layer's
    own slice, without the leading layer axis. Replicated (P()) when no axis splits, and for what nothing declares
    (the RoPE tables)."""
    if info is None:
        return P()
    axes = info.axes[1:] if one_layer else info.axes
    spec = tuple(MODEL if parts.get(_PARTS.get(axis), False) else None for axis in axes)
    return P(*spec) if MODEL in spec else P()


def check_batches(plan: BucketPlan, data: int, mesh_text: str) -> None:
    """Every device batch must split evenly over the data axis: the layout's and the completions' batch buckets."""
    if data == 1:
        return
    completions = [b for b in sorted({b for b, _ in plan.completions()}) if b % data]
    problems = plan.layout.problems(plan.limits, data) + (
        [f"SCOREFN_COMPLETION_BATCH_BUCKETS has {', '.join(map(str, completions))}"] if completions else [])
    if problems:
        raise MeshError(
            f"the mesh {mesh_text} splits every device batch over {data} devices on the data axis, but some batch "
            f"buckets are not multiples of {data}: {'; '.join(problems)}. Use multiples of {data} "
            f"(e.g. {','.join(str(data * k) for k in (1, 2, 4, 8))}) or a smaller data axis (SCOREFN_MESH=DATAxMODEL)")


def _declared_as(path: Sequence[Any]) -> tuple[str, bool]:
    """A state leaf's parameter name (embed, layers.wq, ...) and whether it is an unrolled model's one layer's slice
    (layers.7.wq: the declaration's layers.wq)."""
    keys = [str(key.key) for key in path if isinstance(key, jax.tree_util.DictKey)]
    if keys[0] == "layers" and len(keys) > 2 and keys[1].isdigit():
        return ".".join(["layers", *keys[2:]]), True
    return ".".join(keys), False


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh and where every parameter, input and output of the runtime lives on it."""

    mesh: Mesh
    parts: dict[str, bool]  # attention / kv / mlp / vocab: split over the model axis or replicated
    # Each device runs the single-device program on its own rows (shard_map): a data-only mesh with the
    # batch-invariant kernels, whose rows then get the bits they get on one device (runtime.model.invariant).
    per_device: bool = False

    @property
    def data(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def model(self) -> int:
        return self.mesh.shape[MODEL]

    def sharding(self, role: str) -> NamedSharding:
        spec = {"batch": P(DATA), "kv": P(None, None, MODEL) if self.parts["kv"] else P(), "rep": P()}[role]
        return NamedSharding(self.mesh, spec)

    def staging(self) -> contextlib.AbstractContextManager:
        """Build the model's arrays in host memory, so that weights too large for one device never land
        whole on device 0 before `put_state` places them shard by shard."""
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:  # JAX_PLATFORMS without cpu: build on the default device
            return contextlib.nullcontext()

    def put_state(self, state: Any, declared: Iterable[params.ParamInfo]) -> Any:
        """The model state (nnx.State) with every array placed with its NamedSharding (from its declaration), once,
        at start-up."""
        by_name = {info.name: info for info in declared}

        def put(path, value):
            name, one_layer = _declared_as(path)
            sharding = NamedSharding(self.mesh, param_spec(by_name.get(name), self.parts, one_layer))
            if isinstance(value, jax.ShapeDtypeStruct):  # an abstract state (compiling without weights)
                return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
            return jax.device_put(value, sharding)
        return jax.tree_util.tree_map_with_path(put, state)

    def jit(self, fn: Callable, method: str, state: Any, example_args: Sequence[Any]) -> Any:
        """`jax.jit(fn)` with the shardings of the program's arguments and results (runtime.shapes.programs);
        `state` already placed."""
        program = PROGRAMS[method]
        arg_roles, out_roles = program.arg_roles, program.out_roles
        if len(arg_roles) != len(example_args):
            raise MeshError(f"{method} takes {len(example_args)} arguments, its declaration lists {len(arg_roles)}")
        for role, arg in zip(arg_roles, example_args):
            if role == "batch" and arg.shape[0] % self.data:
                raise MeshError(f"{method}: batch of {arg.shape[0]} rows does not split over {self.data} devices "
                                f"on the data axis")
        if self.per_device:
            spec = lambda role: self.sharding(role).spec
            fn = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), *map(spec, arg_roles)),
                               out_specs=jax.tree.map(spec, out_roles), check_vma=False)
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        in_shardings = (state_shardings, *(self.sharding(role) for role in arg_roles))
        out_shardings = jax.tree.map(self.sharding, out_roles)
        return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)

    def describe(self) -> str:
        on = lambda part: "split" if self.parts[part] else "replicated"
        return (f"mesh {self.data}x{self.model} (data x model) on {self.data * self.model} "
                f"{self.mesh.devices.flat[0].platform} devices; over the model axis: attention {on('attention')}, "
                f"KV heads {on('kv')}, MLP {on('mlp')}, vocabulary {on('vocab')}"
                + ("; each device scores its rows alone (batch-invariant)" if self.per_device else ""))


def make_mesh(data: int, model: int, devices: Sequence[Any]) -> Mesh:
    axis_types = (AxisType.Auto, AxisType.Auto)  # shardings given explicitly; XLA propagates the rest
    try:  # topology-aware device order (TPU rings) where JAX knows one
        return jax.make_mesh((data, model), (DATA, MODEL), axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return Mesh(np.asarray(devices, dtype=object).reshape(data, model), (DATA, MODEL), axis_types=axis_types)


def build_mesh_layout(mesh_text: str, cfg: ModelConfig, plan: BucketPlan, devices: Sequence[Any] | None = None,
                      batch_invariant: bool = False) -> MeshLayout | None:
    """The layout for SCOREFN_MESH on this host's devices, or None for a single device (no sharding at all).
    `batch_invariant`: the platform's kernels are; a data-only mesh then runs each device's rows alone.

    Raises MeshError, naming the numbers, for a layout that cannot work: more devices than the host has, a
    model axis that splits nothing, batch buckets that do not divide by the data axis."""
    devices = list(devices if devices is not None else jax.local_devices())
    data, model = parse_mesh(mesh_text, len(devices))
    if data * model == 1:
        return None
    shown = mesh_text.strip() or f"{data}x{model} (SCOREFN_MESH empty: all local devices on the data axis)"
    check_batches(plan, data, shown)
    parts = sharded_parts(cfg, model, data)
    if data * model < len(devices):
        log.warning("SCOREFN_MESH=%s uses %d of %d devices", mesh_text, data * model, len(devices))
    layout = MeshLayout(make_mesh(data, model, devices[: data * model]), parts, batch_invariant and model == 1)
    log.info("sharding: %s", layout.describe())
    return layout
