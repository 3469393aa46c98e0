"""Progress: a bar on a terminal (tqdm: lines, items/s, ETA), one JSON log line per interval otherwise (what Cloud
Logging reads from a job), and the closing summary."""

from __future__ import annotations

import collections
import logging
import sys
import time
from typing import TextIO

from tqdm import tqdm

log = logging.getLogger("scorefn.batch")


class Progress:
    def __init__(self, total: int, done_before: int, interval_s: float, bar: bool | None = None,
                 stream: TextIO | None = None) -> None:
        """`total`: the shard's lines; `done_before`: those its output already answers. `bar`: None decides by
        whether `stream` (stderr) is a terminal."""
        stream = stream or sys.stderr
        self.total, self.done_before = total, done_before
        self.lines = self.items = 0  # answered by this run
        self.errors: collections.Counter[str] = collections.Counter()
        self._interval_s = interval_s
        self._started = self._logged = time.monotonic()
        use_bar = stream.isatty() if bar is None else bar
        self._bar = tqdm(total=total, initial=done_before, unit="line", dynamic_ncols=True, file=stream,
                         smoothing=0.1) if use_bar else None

    def answered(self, items: int, error: str | None) -> None:
        self.lines += 1
        self.items += items
        if error:
            self.errors[error] += 1
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self.items / max(now - self._started, 1e-9):,.0f} items/s", refresh=False)
        elif now - self._logged >= self._interval_s:
            self._logged = now
            log.info("batch progress", extra={"json_fields": self.fields()})

    def fields(self) -> dict:
        elapsed = time.monotonic() - self._started
        done = self.done_before + self.lines
        rate = self.lines / elapsed if elapsed > 0 else 0.0
        return {"lines": self.total, "answered": done, "answered_now": self.lines, "errors": dict(self.errors),
                "items": self.items, "items_per_s": round(self.items / elapsed, 1) if elapsed > 0 else 0.0,
                "elapsed_s": round(elapsed, 3),
                "eta_s": round((self.total - done) / rate, 1) if rate > 0 else None}

    def close(self) -> dict:
        if self._bar is not None:
            self._bar.close()
        return self.fields()
