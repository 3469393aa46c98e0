"""Small modules and classes: no module over 400 lines and no class over 250 in handler/ and runtime/, but for those
listed below, each with why it is still over. A new module or class over the limits fails here."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
STILL_OVER: dict[str, str] = {}


def _oversized() -> set[str]:
    found = set()
    for top in ("handler", "runtime"):
        for path in sorted((REPO / top).rglob("*.py")):
            name, text = path.relative_to(REPO).as_posix(), path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.add(name)
            found |= {f"{name}:{node.name}" for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ClassDef)
                      and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES}
    return found


def test_modules_and_classes_stay_small():
    oversized = _oversized()
    assert oversized <= STILL_OVER.keys(), f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class: " \
                                           f"{sorted(oversized - STILL_OVER.keys())}"
    assert STILL_OVER.keys() <= oversized, f"small now, drop from STILL_OVER: {sorted(STILL_OVER.keys() - oversized)}"
