"""Each compiled program bound, once, to the model function it runs: the executables (runtime.assembly.executables)
call that function object, never a method looked up by the program's name.

The programs are declared in runtime.shapes.programs, pure Python so that the engine loads without JAX; their model
functions are runtime.model.transformer.Transformer's entry points, so the binding lives here, in the layer that
builds the executables. A new program is one declaration there, one method of Transformer and one line below.
"""

from __future__ import annotations

from typing import Callable

from runtime.model.transformer import Transformer
from runtime.shapes.programs import PROGRAMS, Program

# (program, its model function: called with the model, then the program's arguments)
BINDINGS: tuple[tuple[Program, Callable], ...] = (
    (PROGRAMS["hidden"], Transformer.hidden),
    (PROGRAMS["prefill_context"], Transformer.prefill_context),
    (PROGRAMS["hidden_after_context"], Transformer.hidden_after_context),
    (PROGRAMS["extend_context"], Transformer.extend_context),
    (PROGRAMS["hidden_packed"], Transformer.hidden_packed),
    (PROGRAMS["hidden_packed_after_context"], Transformer.hidden_packed_after_context),
    (PROGRAMS["label_logprobs"], Transformer.label_logprobs),
    (PROGRAMS["lora_class_logits"], Transformer.lora_class_logits),
    (PROGRAMS["class_logits"], Transformer.class_logits),
    (PROGRAMS["token_logprobs"], Transformer.token_logprobs),
    (PROGRAMS["token_logprobs_context"], Transformer.token_logprobs_context),
    (PROGRAMS["token_logprobs_after_context"], Transformer.token_logprobs_after_context),
)
ENTRY_POINTS: dict[Program, Callable] = dict(BINDINGS)


def entry_point(program: Program) -> Callable:
    """The model function `program` runs."""
    return ENTRY_POINTS[program]
