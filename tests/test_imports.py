"""The project's modules import each other without cycles of any kind (type-only imports and imports inside
functions included), at the top of the module: an import inside a function is allowed only where a reason below
says why (an optional dependency, or start-up time). The serving runtime's wings import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("handler", "runtime", "loadtests", "scripts")
# The serving runtime in layers, lowest first (docs/where-things-are.md): a module imports from its own layer and
# those below it, never from one above; the handler, load tests and scripts sit above them all.
LAYERS = ("runtime.shapes", "runtime.requests", "runtime.assembly", "runtime.engine", "handler")

# (module, function) -> why it imports inside the function
INNER_IMPORTS = {
    ("handler.lifecycle", "build_engine"): "handler/ never imports JAX; the engine is built when the app starts",
    ("runtime.engine", "start"): "JAX, Flax and transformers load once the server answers /health",
    ("runtime.model.loader", "load_tokenizer"): "transformers takes seconds to import: on a start's worker thread",
    ("runtime.model.gguf", "gguf_tokenizer"): "transformers: as load_tokenizer",
    ("runtime.model.gguf", "convert_gguf"): "the gguf package (0.3 s) only when a GGUF file is read",
    ("runtime.model.gguf", "read_gguf_weights"): "the gguf package (0.3 s) only when a GGUF file is read",
    ("runtime.assembly.targets", "devices"): "JAX_PLATFORMS is set after a target's name is parsed, before JAX loads",
    ("runtime.tools.baselines", "__init__"): "PyTorch is a test-only dependency (the benchmark's baselines)",
    ("runtime.model.decoder_layer", "_attend"): "Pallas (~0.2 s with Triton, ~0.2 s more with Mosaic) loads only "
                                                 "where a platform runs its kernels: never on a CPU start",
    ("runtime.tools.baselines", "random_checkpoint"): "PyTorch is a test-only dependency",
    ("runtime.tools.bench.lm_eval_mc", "run_lm_eval"): "lm-eval is a test-only dependency (the benchmark skips it "
                                                        "where it is missing)",
}
_OTEL = "OpenTelemetry loads only once tracing is on (runtime.tracing): nothing at all while it is off"
INNER_IMPORTS.update(dict.fromkeys([("runtime.tracing", "configure"), ("runtime.tracing", "_exporters"),
                                    ("runtime.tracing", "_resource"), ("runtime.tracing", "log_fields"),
                                    ("runtime.requests.device_thread", "spans"), ("handler.tracing", "_api"),
                                    ("handler.tracing", "_propagation")], _OTEL))
# every command of the CLI imports what it runs when it runs (runtime/tools/cli.py says why)
INNER_IMPORT_MODULES = {"runtime.tools.cli"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imported(node: ast.AST, known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return ({node.module} & known.keys()) | {f"{node.module}.{alias.name}" for alias in node.names
                                                 if f"{node.module}.{alias.name}" in known}
    return set()


def module_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules a module imports anywhere: at its top, in TYPE_CHECKING blocks, inside functions."""
    return set().union(*(_imported(node, known) for node in ast.walk(ast.parse(path.read_text()))))


def inner_imports(path: Path) -> set[str]:
    """Functions of a module that import inside their body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(inner, (ast.Import, ast.ImportFrom)) for inner in ast.walk(node)):
            found.add(node.name)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: module_imports(path, known) - {name} for name, path in known.items()}
    cycles, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                cycles.append(stack[stack.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, stack + [imported])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_imports_inside_functions_are_only_those_with_a_reason():
    unexplained = sorted(f"{name}.{function}" for name, path in modules().items() if name not in INNER_IMPORT_MODULES
                         for function in inner_imports(path) if (name, function) not in INNER_IMPORTS)
    assert not unexplained, f"imports inside functions without a reason in tests/test_imports.py: {unexplained}"
    stale = sorted(f"{name}.{function}" for name, function in INNER_IMPORTS
                   if function not in inner_imports(modules()[name]))
    assert not stale, f"reasons for imports that are gone: {stale}"


def _layer(name: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if name == layer or name.startswith(layer + ".")), None)


def test_the_runtimes_layers_import_only_downward():
    known = modules()
    upward = sorted(f"{name} -> {imported}" for name, path in known.items() if _layer(name) is not None
                    for imported in module_imports(path, known)
                    if _layer(imported) is not None and _layer(imported) > _layer(name))
    assert not upward, f"imports up the layers {LAYERS}: {upward}"
    assert {_layer(name) for name in known} >= set(range(len(LAYERS))), "a layer without modules: update LAYERS"
