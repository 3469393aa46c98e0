"""A pytest plugin: each test module's seconds (setup, call and teardown of its tests) and the XLA compile seconds
of the test processes, by module, printed after the slowest tests, so the next person sees which modules cost the
suite its time and how much of it is compiling (servers the tests start in other processes compile on their own and
are not counted as compiles). Under pytest-xdist each worker counts its own compiles and hands them to the
controller, which prints the sum; the controller sees every test's report, so it sums the seconds itself."""

from __future__ import annotations

import collections

import pytest

_seconds: collections.Counter = collections.Counter()
_counts: collections.Counter = collections.Counter()
_module_seconds: collections.Counter = collections.Counter()
_current = ["(collection)"]


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _seconds[_current[0]] += seconds
        _counts[_current[0]] += 1


def pytest_configure(config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid.split("::")[0]
    try:
        return (yield)
    finally:
        _current[0] = "(between tests)"


def pytest_runtest_logreport(report) -> None:
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set on an xdist worker only
    if workeroutput is not None:
        workeroutput["xla_compiles"] = {module: (_seconds[module], _counts[module]) for module in _counts}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    for module, (seconds, count) in getattr(node, "workeroutput", {}).get("xla_compiles", {}).items():
        _seconds[module] += seconds
        _counts[module] += count


@pytest.hookimpl(trylast=True)  # after the slowest tests
def pytest_terminal_summary(terminalreporter) -> None:
    if _module_seconds:
        terminalreporter.section("Seconds by test module (setup, call and teardown)")
        for module, seconds in _module_seconds.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
        terminalreporter.write_line(f"{sum(_module_seconds.values()):8.1f} s  in all")
    if not _counts:
        return
    terminalreporter.section("XLA compiles in the test processes, by module")
    for module, seconds in _seconds.most_common(15):
        terminalreporter.write_line(f"{seconds:8.1f} s {_counts[module]:5d} compiles  {module}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} s {sum(_counts.values()):5d} compiles  in all")
