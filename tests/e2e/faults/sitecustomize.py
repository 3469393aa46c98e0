"""Fault injection for a real `scorefn serve` process (tests/e2e/test_failed_start.py puts this folder first on
PYTHONPATH, so every Python process of the server runs it at start-up).

SCOREFN_TEST_MISSING=jinja2: importing that package fails as if it were not installed.
SCOREFN_TEST_COMPILE_FAILS=1: XLA compilation of the runtime's executables fails.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_MISSING = os.environ.get("SCOREFN_TEST_MISSING")
_COMPILE_FAILS = os.environ.get("SCOREFN_TEST_COMPILE_FAILS") == "1"


class _Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):  # not reached
        raise AssertionError


class _PatchCompile(importlib.abc.Loader):
    """Loads runtime.assembly.executables as usual, then makes every compilation fail the way XLA's errors surface."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)

        def add(self, method, key, lowered):
            raise RuntimeError(f"INTERNAL: compilation of {method}{key} failed (injected by the test)")
        module.Executables.add = add


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if _MISSING and name.partition(".")[0] == _MISSING:
            return importlib.machinery.ModuleSpec(name, _Missing())
        if _COMPILE_FAILS and name == "runtime.assembly.executables":
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            spec.loader = _PatchCompile(spec.loader)
            return spec
        return None


if _MISSING or _COMPILE_FAILS:
    sys.meta_path.insert(0, _Finder())
