"""A real `scorefn serve` process on a free loopback port, with small buckets so it starts quickly."""

from __future__ import annotations

import pytest

from runtime.serverproc import ServerProcess

SMALL_BUCKETS = {
    "SCOREFN_DTYPE": "float32",
    "SCOREFN_LENGTH_BUCKETS": "32,64",
    "SCOREFN_BATCH_BUCKETS": "1,4,16",
    "SCOREFN_SUFFIX_LENGTH_BUCKETS": "16",
    "SCOREFN_SUFFIX_BATCH_BUCKETS": "8",
    "SCOREFN_MAX_LABELS": "64",
}


@pytest.fixture(scope="session")
def server():
    with ServerProcess(env=SMALL_BUCKETS) as process:
        yield process
