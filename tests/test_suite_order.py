"""tests/conftest.py's LONGEST_FIRST names modules that exist: a renamed module would silently lose its place."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST, REPO


def test_the_longest_modules_named_first_exist():
    assert [module for module in LONGEST_FIRST if not (REPO / module).is_file()] == []
