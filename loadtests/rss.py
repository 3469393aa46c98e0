"""The server's resident memory over a load test, and whether it grows steadily (loadtests.run and
loadtests.overload both sample it and judge a soak by it).
"""

from __future__ import annotations

import statistics
import threading
import time

import psutil


class RssSampler:
    """Resident memory of a process and its children (granian's worker), sampled on a thread."""

    def __init__(self, pid: int, interval: float) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MB)
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mb(self) -> float:
        total = 0
        for process in [self.process, *self.process.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._started, self.rss_mb()))
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Steady RSS growth in MB/min: the Theil-Sen slope (median of the pairwise slopes) over the second half
    of the samples. The first half is warm-up; a one-off step (a new allocator arena, the first use of a
    buffer size) moves the median little, growth with every request moves all of it."""
    half = samples[len(samples) // 2:]
    slopes = [(m2 - m1) / (t2 - t1) for i, (t1, m1) in enumerate(half) for t2, m2 in half[i + 1:] if t2 > t1]
    if len(half) < 3 or not slopes:
        return 0.0
    return statistics.median(slopes) * 60
