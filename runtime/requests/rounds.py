"""What the engine (runtime.engine) needs of a scorer, as a protocol: pure Python, so that the engine's module loads
without JAX (it loads at start, once the server answers /health)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from runtime.requests.cost import Work
from runtime.requests.jobs import Job, TokenJob


# What a scorer counts for /metrics (RoundScorer.counters).
COUNTERS = ("compiles", "backend_compiles", "device_batches", "device_batch_sequences")


@runtime_checkable
class RoundScorer(Protocol):
    """What the engine (runtime.engine) needs of a scorer: the device work of jobs, for admission; the rows of a job
    worth a slice of a round; a round dispatched without waiting for the device, then collected; and its counters
    for /metrics. Scorer is the one that serves; the engine's tests run stand-ins (tests/runtime/engine/stubs.py)."""

    def cost(self, jobs: Sequence[Job | TokenJob], marginal: bool = False) -> Work: ...

    def slice_rows(self, job: Job | TokenJob) -> int: ...

    def dispatch(self, jobs: Sequence[Job | TokenJob]) -> Any: ...

    def collect(self, dispatched: Any) -> list: ...

    def counters(self) -> dict[str, int]: ...
