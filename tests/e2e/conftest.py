"""A real `scorefn serve` process on a free loopback port, with small buckets so it starts quickly."""

from __future__ import annotations

import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess

__all__ = ["SMALL_BUCKETS", "server"]


@pytest.fixture(scope="session")
def server():
    with ServerProcess(env=SMALL_BUCKETS) as process:
        yield process
