"""Start `scorefn serve` as a child process on a free loopback port and wait until it is ready.

Used by the end-to-end tests, the benchmark's HTTP workload and the load-test runner. Readiness is
detected from the server's own "ready" log line (no polling loop), then confirmed on GET /ready; a start that
deferred stored executables until after ready is then waited for until it loaded them (its log line), so that what
is measured next is the server's steady state.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path


# Few, short shape buckets: a server that compiles (or loads from the cache) in seconds, for tests and load runs.
# The longest sequence it accepts is 64 tokens.
SMALL_BUCKETS = {
    "SCOREFN_DTYPE": "float32",
    "SCOREFN_LENGTH_BUCKETS": "32,64",
    "SCOREFN_BATCH_BUCKETS": "1,4,16",
    "SCOREFN_SUFFIX_LENGTH_BUCKETS": "16",
    "SCOREFN_SUFFIX_BATCH_BUCKETS": "8",
    "SCOREFN_MAX_LABELS": "64",
}


def scorefn_command(*args: str) -> list[str]:
    """The `scorefn` console script with these arguments. It is this Python's, unless SCOREFN_SERVE_EXECUTABLE
    names another (the test suite points it at the serve-only venv's, as `make serve` installs it: no PyTorch
    there for transformers to import, ~7 s less per start)."""
    return [os.environ.get("SCOREFN_SERVE_EXECUTABLE") or str(Path(sys.executable).with_name("scorefn")), *args]


def serve_command(interface: str = "asgi") -> list[str]:
    """The same command as `make serve` and the container's ENTRYPOINT."""
    return scorefn_command("serve", "--interface", interface)


def request_json(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """GET (or POST `body` as JSON) with the standard library only; (status, decoded JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:  # 4xx/5xx: the body is the RFC-006 envelope
        with error:
            return error.code, json.loads(error.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, env: dict[str, str] | None = None, interface: str = "asgi", start_timeout: float = 600,
                 log_path: Path | None = None, settle: bool = True):
        """`log_path`: also write every line the server prints there (the last 2,000 are kept in `lines`).
        `settle`: return once the executables deferred at start are loaded and those pending at ready compiled
        too (else at /ready)."""
        self.port = free_port()
        self._log = open(log_path, "w") if log_path else None
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: deque[str] = deque(maxlen=2000)
        self.startup_timings: dict = {}  # the start's phases and counts, from its "warm-up done" log line
        self._ready = threading.Event()
        self._settled = threading.Event()  # ready, and every deferred stored executable loaded
        self._exited = threading.Event()
        self._printed = threading.Condition()  # notified on each line the server prints
        full_env = {**os.environ, **(env or {}), "PORT": str(self.port), "SCOREFN_HOST": "127.0.0.1"}
        self.proc = subprocess.Popen(serve_command(interface),
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_ready(start_timeout, settle)

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._printed:
                self.lines.append(line)
                self._printed.notify_all()
            if self._log:
                self._log.write(line)
            try:
                record = json.loads(line)
                message = record.get("message", "")
            except (ValueError, AttributeError):
                continue
            if message.startswith("warm-up done"):
                self.startup_timings = record.get("timings", {})
            elif message.startswith("executable store: the") and "deferred at start loaded" in message:
                if not self.startup_timings.get("pending"):  # and nothing left to compile after ready
                    self._settled.set()
            elif message.startswith("compiled the") and "pending at ready" in message:
                self._settled.set()
            elif message == "ready":
                self._ready.set()
                if not self.startup_timings.get("deferred") and not self.startup_timings.get("pending"):
                    self._settled.set()  # nothing left to load or compile after ready
        if self._log:
            self._log.close()
        self._exited.set()
        self._ready.set()  # wake the waiters: they check whether the process died
        self._settled.set()

    def wait_ready(self, timeout: float, settle: bool = True) -> None:
        if not self._ready.wait(timeout) or (settle and not self._settled.wait(timeout)) or self._exited.is_set():
            self.stop()
            raise RuntimeError("server did not become ready:\n" + "".join(list(self.lines)[-40:]))
        with urllib.request.urlopen(self.url + "/ready", timeout=10) as response:
            assert response.status == 200

    def wait_settled(self, timeout: float) -> bool:
        """Wait until the server has loaded what it deferred at start and compiled what was pending at ready."""
        return self._settled.wait(timeout) and not self._exited.is_set()

    def wait_for_line(self, wanted: Callable[[str], bool], timeout: float) -> str | None:
        """The first line the server printed (of the last 2,000) that is `wanted`, waiting up to `timeout` for it."""
        with self._printed:
            self._printed.wait_for(lambda: any(map(wanted, self.lines)) or self._exited.is_set(), timeout)
            return next(filter(wanted, self.lines), None)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._exited.wait(5):
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
