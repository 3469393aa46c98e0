"""runtime.assembly.entry_points: every program in the program table bound to exactly one model function."""

from __future__ import annotations

import collections

from runtime.assembly.entry_points import BINDINGS, entry_point
from runtime.model.transformer import Transformer
from runtime.shapes.programs import PROGRAMS


def test_every_program_has_exactly_one_binding():
    bound = collections.Counter(program for program, _ in BINDINGS)
    assert bound == collections.Counter(PROGRAMS.values())


def test_each_binding_is_an_entry_point_of_the_model():
    for program, function in BINDINGS:
        assert entry_point(program) is function
        assert getattr(Transformer, function.__name__) is function, program.name  # its own or EveryPosition's
        assert not function.__name__.startswith("_"), program.name
