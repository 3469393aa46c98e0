"""How a round's device batches are launched (runtime.requests.scorer builds them): a device batch is a function that
runs its programs in order (the forward pass, then the heads that read it) and returns its outputs with the rows
each answers; batches do not depend on one another.

XLA:CPU runs a program from the thread that launches it: a second launch from the same thread starts when the first
has finished, one from another thread runs beside it. Inside a program only the matmuls use every core; its fusions
(norms, casts, the vocabulary head's log-sum-exp, attention's small matmuls and softmax) run on one. So on a CPU of
two cores a second launcher thread overlaps one batch's single-threaded work with another's: the embedded model's W1
(256 items, 8 device batches) took 0.91x the time, W2 0.92x, W4's per-position log-probabilities 0.85x, W5 0.98x,
and a third thread did no better (AMD EPYC Zen 4, 2 cores, 2026-11-29). The bits do not move: every batch is the same
compiled program on the same inputs (tests/runtime/requests/test_launch.py). The platform decides how many threads
(runtime.assembly.platform's `concurrent_batches`); one launches every batch from the dispatching thread, as JAX
dispatches, which is what an accelerator's queue wants.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable

import jax

Entries = list[tuple[Any, list]]  # a batch's outputs, each with the rows it answers
Run = Callable[..., Any]  # run(program, bucket, *args): one program, recorded


# Launcher threads a CPU may use. Two were faster (above). Admission's service model (runtime.requests.cost) prices
# a round by its batches two at a time, from their overlap measured at start (runtime.assembly.calibration): priced
# one at a time, the open-loop overload test (tests/e2e) failed once at 0.7x its capacity, and a simulated device of
# two lanes left requests queued past their deadline (tests/runtime/requests/test_scheduler_simulated.py).
MAX_CPU_THREADS = 2


def cpu_threads(cores: int | None = None) -> int:
    """Launcher threads on a CPU: up to MAX_CPU_THREADS, one per core this process may run on (`cores`: default, its
    CPU affinity). A second fills the core a batch's single-threaded fusions leave idle; a third found nothing more to
    fill on 2 cores, and more cores speed up the matmuls, not those fusions."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return min(MAX_CPU_THREADS, max(cores, 1))


class Launched:
    """A launched device batch: the programs it ran (`program[bucket]`, in order) and its outputs."""

    def __init__(self) -> None:
        self.programs: list[str] = []
        self._entries: Entries = []
        self._future: concurrent.futures.Future | None = None

    def entries(self) -> Entries:
        """Its outputs (waiting for a batch run by a launcher thread; its error raised here)."""
        return self._future.result() if self._future is not None else self._entries


class Launcher:
    """Runs device batches through `programs` (runtime.requests.scorer.Programs): from the calling thread (`threads`
    1), or from a pool of `threads`, each batch on one of them, start to finish."""

    def __init__(self, programs: Callable[..., Any], threads: int = 1):
        self._programs = programs
        self.threads = threads  # batches run at once (the service model prices rounds by them)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="scorefn-batch") \
            if threads > 1 else None

    def launch(self, batch: Callable[[Run], Entries], after: Any = None, now: bool = False) -> Launched:
        """Launch `batch(run)`. `after`: arrays it reads that an earlier launch computes (a launcher thread waits for
        them first, so that the batch runs on that thread). `now`: from the calling thread whatever the pool (a
        shared prefix's keys and values, which the batches after it read)."""
        launched = Launched()

        def run(program: str, bucket: tuple, *args: Any) -> Any:
            launched.programs.append(f"{program}{list(bucket)}")
            return self._programs(program, bucket, *args)

        if self._pool is None or now:
            launched._entries = batch(run)
            return launched

        def on_a_launcher_thread() -> Entries:
            jax.block_until_ready(after)
            entries = batch(run)
            jax.block_until_ready([output for output, _ in entries])  # the thread holds its batch until done
            return entries
        launched._future = self._pool.submit(on_a_launcher_thread)
        return launched
