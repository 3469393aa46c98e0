"""Structured logs: one JSON access line per request, in the shape Cloud Logging parses from stdout.

Fields travel in `record.json_fields` (the name google-cloud-logging's StructuredLogHandler uses) so that
any handler can read them; configure_logging() installs a formatter that prints them as one JSON object.
Bodies are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

from runtime import tracing

access_log = logging.getLogger("scorefn.access")

_MAX_PATH_CHARS = 512
_SEVERITY = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING",
             logging.ERROR: "ERROR", logging.CRITICAL: "CRITICAL"}


def log_access(*, request_id: str, method: str, path: str, status: int, total_seconds: float,
               items: int | None = None, tokens: int | None = None,
               queue_seconds: float | None = None, device_seconds: float | None = None, quiet: bool = False) -> None:
    """Severity: 5xx ERROR, 4xx WARNING, else INFO. `quiet`: a probe or scrape (/health, /ready, /metrics), always
    DEBUG: a 503 from /ready while warming up or draining is expected, not an error (an unexpected failure of
    the handler is logged on its own, with its traceback)."""
    level = (logging.DEBUG if quiet else logging.ERROR if status >= 500 else logging.WARNING if status >= 400
             else logging.INFO)
    if not access_log.isEnabledFor(level):
        return
    path = path[:_MAX_PATH_CHARS]
    fields: dict[str, Any] = {
        "request_id": request_id, "method": method, "path": path, "status": status,
        "items": items, "tokens": tokens, "queue_s": queue_seconds, "device_s": device_seconds,
        "total_s": round(total_seconds, 6),
        # Cloud Logging shows this as the request line of the entry.
        "httpRequest": {"requestMethod": method, "requestUrl": path, "status": status,
                        "latency": f"{total_seconds:.6f}s"},
    }
    access_log.log(level, "%s %s %d", method, path, status,
                   extra={"json_fields": {k: v for k, v in fields.items() if v is not None}})


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line: severity, message, logger, the record's json_fields, the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "severity": _SEVERITY.get(record.levelno, record.levelname),
            "message": record.getMessage(),
            "logger": record.name,
        }
        payload.update(getattr(record, "json_fields", None) or {})
        payload.update(tracing.log_fields())  # written while serving a request: its span's ids
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(stream: TextIO | None = None, level: int | str = logging.INFO) -> None:
    """JSON lines on stdout for every `scorefn.*` logger; called by the served apps, idempotent."""
    logger = logging.getLogger("scorefn")
    if any(getattr(h, "_scorefn", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(JsonLineFormatter())
    handler._scorefn = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # one line per record, even when the server also configures the root logger
