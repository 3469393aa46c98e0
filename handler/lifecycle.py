"""Engine warm-up and shutdown, shared by both faces; all of it blocking, so it runs off the request path."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from handler.core import ScoringCore
from runtime import tracing
from runtime.interface import ScoringEngine
from runtime.settings import Settings

log = logging.getLogger("scorefn.handler")


def build_engine(settings: Settings) -> ScoringEngine:
    # Imported here, when an app builds its real engine: runtime.engine pulls in JAX, which handler/
    # never imports (it serves any runtime.interface.ScoringEngine; its tests run a fake one without JAX).
    from runtime.engine import build_engine as build

    return build(settings)


# A served process whose engine cannot start exits with this status. gunicorn reads a worker's exit status 3
# as "failed to boot" and stops instead of respawning it; granian stops with status 1 when its worker exits.
EXIT_START_FAILED = 3


def warm_up(core: ScoringCore, owns_process: bool = False) -> None:
    """Build the core's engine if it has none, then start it (loads weights, compiles every bucket).

    `owns_process` (the served apps): tracing is set up from the OTEL_* variables first (runtime.tracing), and a
    start that fails logs its cause once, at CRITICAL with the traceback, and ends the process at once, so `make
    serve` returns with the message on screen and Cloud Run or Kubernetes restart the instance and show the
    failure. Otherwise (apps built in tests) the failure is logged at ERROR and /ready stays 503.
    """
    started = time.perf_counter()
    try:
        if owns_process and tracing.configure():
            log.info("tracing: exporting spans (OTEL_* variables)")
        if core.engine is None:
            core.engine = build_engine(core.settings)
        if not core.engine.ready:
            core.engine.start()
    except Exception as exc:
        if not owns_process:
            log.exception("engine start failed; /ready stays 503")
            return
        log.critical("engine start failed, exiting: %s: %s", type(exc).__name__, exc, exc_info=True)
        exit_now(EXIT_START_FAILED)
    log.info("ready", extra={"json_fields": {"model": core.engine.model_id,
                                             "warmup_s": round(time.perf_counter() - started, 3)}})


def exit_now(status: int) -> None:
    """End the process from any thread (sys.exit would end only the calling one), logs flushed first."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for handler in logging.getLogger("scorefn").handlers:
        handler.flush()
    os._exit(status)


def shut_down(core: ScoringCore) -> None:
    """Refuse new work (/ready 503), then let the engine finish what is queued within drain_grace_s."""
    core.start_draining()
    if core.engine is not None:
        core.engine.stop(core.settings.drain_grace_s)
        log.info("stopped")
    tracing.flush()  # the last requests' spans leave before the process does


class Drain:
    """Runs shut_down(core) once, started by SIGTERM or by the server's own shutdown, whichever comes first.

    The server (granian) stops accepting on SIGTERM but runs the ASGI lifespan shutdown only after its last
    connection is done, so without this the grace period would start too late: the SIGTERM hook turns /ready
    to 503 at once and starts the engine's grace period, after which still-queued work is answered 503.
    """

    def __init__(self, core: ScoringCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._done = False
        self._signalled = threading.Event()

    def __call__(self) -> None:
        """Drain now (blocking); a second caller waits for the first one's drain to end."""
        with self._lock:
            if not self._done:
                shut_down(self._core)
                self._done = True

    def on_sigterm(self) -> bool:
        """Drain when this process gets SIGTERM, then call the handler installed before (the server's).

        Only the main thread can set signal handlers; returns whether the hook was installed.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):  # default action or ignored: nobody would stop the server after the drain
            return False
        # The handler runs between two bytecodes of the main thread: it only flips flags; a thread drains.
        threading.Thread(target=self._drain_when_signalled, name="scorefn-drain", daemon=True).start()

        def handler(signum: int, frame: object) -> None:
            self._core.start_draining()
            self._signalled.set()
            previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        return True

    def _drain_when_signalled(self) -> None:
        self._signalled.wait()
        log.info("SIGTERM: draining for up to %g s", self._core.settings.drain_grace_s)
        self()


class BackgroundWarmup:
    """Runs warm_up once per process in a daemon thread (WSGI has no lifespan; a forked worker starts its own)."""

    def __init__(self, core: ScoringCore, owns_process: bool = False) -> None:
        self._core = core
        self._owns_process = owns_process
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.thread: threading.Thread | None = None

    def ensure_started(self) -> None:
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self.thread = threading.Thread(target=warm_up, args=(self._core, self._owns_process),
                                           name="scorefn-warmup", daemon=True)
            self.thread.start()
