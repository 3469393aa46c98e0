"""A pytest plugin: each test module's seconds (setup, call and teardown of its tests) and what the test processes
spent making programs, by module, printed after the slowest tests: XLA compiles (seconds and count, of which loaded
from JAX's persistent cache), tracing and lowering to MLIR (which a persistent-cache hit still pays), and executables
loaded from the executable store (which pay none of them). So the next person sees which modules cost the suite its
time and how much of it is making programs (servers the tests start in other processes compile on their own and are
not counted). Under pytest-xdist each worker counts its own and hands them to the controller, which prints the sum;
the controller sees every test's report, so it sums the seconds itself."""

from __future__ import annotations

import collections
import resource

import pytest

# JAX's monitoring events: a compile (a persistent-cache hit included), a persistent-cache hit, tracing, lowering;
# and the executable store's load (runtime.assembly.store.STORE_LOAD_EVENT, recorded through the same monitoring)
COMPILE, HIT = "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"
TRACE, LOWER = "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"
_store_load = [""]  # set once JAX is imported (pytest_configure)
_made: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_module_seconds: collections.Counter = collections.Counter()
_module_cpu: collections.Counter = collections.Counter()  # CPU seconds of the test process and what it waited for
_current = ["(collection)"]


def _on_duration(event: str, seconds: float, **_) -> None:
    made = _made[_current[0]]
    if event == COMPILE:
        made["compile_s"] += seconds
        made["compiles"] += 1
    elif event == TRACE:
        made["trace_s"] += seconds
    elif event == LOWER:
        made["lower_s"] += seconds


def _on_event(event: str, **_) -> None:
    if event == HIT:
        _made[_current[0]]["hits"] += 1
    elif event == _store_load[0]:
        _made[_current[0]]["stored"] += 1


def pytest_configure(config) -> None:
    import jax

    from runtime.assembly.store import STORE_LOAD_EVENT

    _store_load[0] = STORE_LOAD_EVENT
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def _cpu_seconds() -> float:
    """User and system seconds of this process and of the children it has waited for (servers, workers)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                                    resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid.split("::")[0]
    started = _cpu_seconds()
    try:
        return (yield)
    finally:
        _module_cpu[_current[0]] += _cpu_seconds() - started
        _current[0] = "(between tests)"


def pytest_runtest_logreport(report) -> None:
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set on an xdist worker only
    if workeroutput is not None:
        workeroutput["programs_made"] = {module: dict(made) for module, made in _made.items() if made}
        workeroutput["cpu_seconds"] = dict(_module_cpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    output = getattr(node, "workeroutput", {})
    for module, made in output.get("programs_made", {}).items():
        _made[module].update(made)
    _module_cpu.update(output.get("cpu_seconds", {}))


@pytest.hookimpl(trylast=True)  # after the slowest tests
def pytest_terminal_summary(terminalreporter) -> None:
    if _module_seconds:
        # Wall seconds include waiting for the cores another worker holds; CPU seconds are the module's own work.
        terminalreporter.section("Seconds by test module (setup, call and teardown): wall, and CPU of its processes")
        for module, seconds in _module_seconds.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f} s  {_module_cpu[module]:8.1f} s CPU  {module}")
        terminalreporter.write_line(f"{sum(_module_seconds.values()):8.1f} s  {sum(_module_cpu.values()):8.1f} s CPU"
                                    f"  in all")
    made = {module: counts for module, counts in _made.items() if counts}
    if not made:
        return
    terminalreporter.section("Programs made in the test processes, by module")
    terminalreporter.write_line(f"{'compile':>9} {'compiles':>8} {'of them hits':>12} {'trace':>8} {'lower':>8} "
                                f"{'from store':>10}  module")

    def line(counts: collections.Counter, name: str) -> str:
        return (f"{counts['compile_s']:8.1f}s {counts['compiles']:8d} {counts['hits']:12d} {counts['trace_s']:7.1f}s "
                f"{counts['lower_s']:7.1f}s {counts['stored']:10d}  {name}")
    ranked = sorted(made, key=lambda m: -(made[m]["compile_s"] + made[m]["trace_s"] + made[m]["lower_s"]))
    for module in ranked[:20]:
        terminalreporter.write_line(line(made[module], module))
    terminalreporter.write_line(line(sum(made.values(), collections.Counter()), "in all"))
