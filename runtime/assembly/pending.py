"""Buckets a start left to compile after ready (SCOREFN_READY=first): compiled by one background compiler, smallest
first, those a round waits for next; never in a round's own thread while the compiler runs."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

log = logging.getLogger("scorefn.runtime")


class PendingCompiles:
    """The (program, bucket)s not compiled at warm-up. `compile_key(key)` compiles one (and keeps it where
    `is_compiled(key)` sees it)."""

    def __init__(self, compile_key: Callable[[tuple], None], is_compiled: Callable[[tuple], bool]):
        self._compile_key = compile_key
        self._is_compiled = is_compiled
        self._pending: set[tuple] = set()
        self._compiling: set[tuple] = set()  # taken from _pending, not compiled yet
        self._wanted: list[tuple] = []  # those a round waits for, in the order asked
        self._failed: dict[tuple, Exception] = {}
        self._changed = threading.Condition()  # guards the four above; notified as each is compiled
        self._running = False  # until then (the start, before ready), a pending bucket compiles on first use

    def add(self, keys: list[tuple]) -> None:
        with self._changed:
            self._pending.update(keys)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: tuple) -> bool:
        return key in self._pending or key in self._compiling

    def wait_for(self, key: tuple) -> bool:
        """A pending bucket: compiled by the background compiler, which takes it next while this waits; compiled here
        when no compiler runs (the start, before ready; a stopping server's drain)."""
        while True:
            with self._changed:
                if self._is_compiled(key):
                    return True
                if key in self._failed:
                    raise RuntimeError(f"{key[0]}{key[1]} did not compile") from self._failed[key]
                if not self._running and key in self._pending:
                    self._pending.discard(key)
                    self._compiling.add(key)
                    break
                if key not in self._wanted:
                    self._wanted.append(key)
                    self._changed.notify_all()
                self._changed.wait()
        try:
            self._compile_key(key)
        finally:
            with self._changed:
                self._compiling.discard(key)
                self._changed.notify_all()
        return True

    def compile_all(self, progress: Callable[[int, str, float], None] | None = None,
                    stopped: Callable[[], bool] = lambda: False) -> int:
        """The background compiler: every pending bucket, those a round waits for first, then smallest first. Once
        `stopped()`, only those a round waits for. Returns how many it compiled."""
        done = 0
        with self._changed:
            self._running = True
        try:
            while True:
                with self._changed:
                    wanted = [key for key in self._wanted if key in self._pending]
                    if not wanted and (not self._pending or stopped()):
                        break
                    key = wanted[0] if wanted else min(self._pending, key=lambda k: (math.prod(k[1]), k))
                    self._pending.discard(key)
                    self._compiling.add(key)
                started = time.perf_counter()
                try:
                    self._compile_key(key)
                except Exception as exc:  # a round waiting for it fails, saying why; the others go on
                    log.exception("%s%s did not compile after ready", *key)
                    self._failed[key] = exc
                with self._changed:
                    self._compiling.discard(key)
                    if key in self._wanted:
                        self._wanted.remove(key)
                    self._changed.notify_all()
                done += 1
                if progress:
                    progress(done, f"{key[0]}{key[1]}", time.perf_counter() - started)
        finally:
            with self._changed:  # a round that waits for one still pending (a stopping server's) compiles it itself
                self._running = False
                self._changed.notify_all()
        return done
