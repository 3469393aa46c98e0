"""runtime.shapes.programs: every compiled program declared once, and everything else reads it."""

from __future__ import annotations

import inspect

import pytest

from runtime.assembly import sharding
from runtime.assembly.entry_points import entry_point
from runtime.shapes.buckets import BucketPlan
from runtime.shapes.grid import GridLayout
from runtime.shapes.packed import PackedLayout
from runtime.shapes.programs import KINDS, PROGRAMS, ModelShapes
from tests.runtime.conftest import TINY

SHAPES = ModelShapes(layers=2, kv_heads=2, head_dim=16, hidden=64, attention_dtype="float32")
ROLES = {"batch", "kv", "rep"}


def plans() -> list[BucketPlan]:
    shared = dict(lengths=(16, 32), max_tokens=4096, labels=(4, 16), context_lengths=(16,), prefix_sharing=True,
                  completion_batches=(1, 4), lora=True, kept_prompts=16)
    return [BucketPlan(layout=GridLayout((1, 4), (8,), (4,)), **shared),
            BucketPlan(layout=PackedLayout(width=16, rows=(1, 2), narrow=(8,), narrow_continuations=(8,),
                                           wide_rows=(1,), slots=(4, 8)), **shared)]


def compiled() -> dict[str, list[tuple[int, ...]]]:
    """Every program's buckets over both layouts and both tasks."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for plan in plans():
        for task in ("causal_lm", "sequence_classification"):
            for program, bucket in plan.programs(task):
                out.setdefault(program.name, []).append(bucket)
    return out


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_program_has_a_model_function_a_sharding_a_cost_and_buckets(name):
    program = PROGRAMS[name]
    method = entry_point(program)  # the model function it runs
    buckets = compiled()[name]  # some layout compiles it
    assert buckets and program.kind in KINDS
    parameters = list(inspect.signature(method).parameters)[1:]
    for bucket in buckets:
        args = program.args(bucket, SHAPES)
        assert len(args) == len(parameters) == len(program.arg_roles), (name, parameters)
        assert set(program.arg_roles) <= ROLES
        outputs = program.out_roles if isinstance(program.out_roles, tuple) else (program.out_roles,)
        assert set(outputs) <= ROLES
        flops, traffic = program.cost(bucket, _config(), weight_bytes=1000)
        assert flops > 0 and traffic > 0
        assert (program.tokens(bucket) > 0) == (program.kind != "head")
        # LoRA slots x rank: each token's projections take (I + O) * columns multiply-adds more, in every layer
        # (TINY: hidden 64, 4 heads of 16, 2 KV heads, MLP 96, 2 layers)
        with_lora, _ = program.cost(bucket, _config(), weight_bytes=1000, lora_columns=8)
        widths = 2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 96)
        assert with_lora - flops == program.tokens(bucket) * 2 * 8 * widths * 2


def test_sharding_reads_the_roles_from_the_declarations():
    tables = [name for name, value in vars(sharding).items()
              if isinstance(value, dict) and "hidden" in value and value is not PROGRAMS]
    assert not tables  # no table of its own: a program's roles are in its declaration


def test_a_bucket_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"hidden buckets are \('batch', 'length'\)"):
        PROGRAMS["hidden"].args((1, 2, 3), SHAPES)


def _config():
    from runtime.model.config import config_from_hf

    return config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY})
