"""Every package the served code imports is a main dependency in pyproject.toml.

The test extras (PyTorch pulls in jinja2, for one) would hide a missing one from the test suite; this reads
the imports themselves. What a dependency imports lazily (transformers rendering a chat template with jinja2)
no reading of our sources can see: `make test` also runs scripts/serve_check.py in a serve-only venv.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

from tests.conftest import top_level_imports

REPO = Path(__file__).resolve().parent.parent
SERVED = ("handler", "runtime")
# `scorefn bench` is a development tool: PyTorch (the test extra) for its baselines, lm-eval for its run of lm-eval.
DEV_ONLY = {"runtime/tools/baselines.py": {"torch"}, "runtime/tools/bench/lm_eval_mc.py": {"lm_eval"}}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_normalized(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in project["dependencies"]}


def test_every_served_import_is_a_main_dependency():
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for package in SERVED:
        for path in sorted((REPO / package).rglob("*.py")):
            where = str(path.relative_to(REPO))
            for module in sorted(top_level_imports(path) - set(SERVED) - {"__future__"} - DEV_ONLY.get(where, set())):
                owners = {_normalized(d) for d in distributions.get(module, [module])}
                if not owners & declared:
                    missing.append(f"{where} imports {module} ({', '.join(sorted(owners))})")
    assert not missing, "not in pyproject.toml's main dependencies:\n" + "\n".join(missing)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_arrows_run_one_way():
    """handler/ depends on runtime.interface and never imports JAX; runtime/ never imports handler/ or Litestar."""
    wrong = []
    for path in sorted((REPO / "handler").rglob("*.py")):
        wrong += [f"{path.relative_to(REPO)} imports {m}" for m in _imports(path) if m.partition(".")[0] in ("jax", "flax")]
    for path in sorted((REPO / "runtime").rglob("*.py")):
        wrong += [f"{path.relative_to(REPO)} imports {m}" for m in _imports(path)
                  if m.partition(".")[0] in ("handler", "litestar", "granian")]
    assert not wrong, "\n".join(wrong)
