"""A real `scorefn serve` process on a free loopback port, with small buckets so it starts quickly."""

from __future__ import annotations

import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess

__all__ = ["FUNCTIONAL", "SMALL_BUCKETS", "server"]

# Servers of functional tests: admission never refuses their requests. `make test` runs beside other tests on the
# same cores, and a server that measured its speed while they compiled predicts long waits and answers 429 (its
# right: admission is judged in test_overload.py and tests/runtime/requests, not here).
FUNCTIONAL = {**SMALL_BUCKETS, "SCOREFN_MAX_WAIT_S": "600"}


@pytest.fixture(scope="session")
def server():
    with ServerProcess(env=FUNCTIONAL) as process:
        yield process
