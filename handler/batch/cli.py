"""`scorefn batch INPUT OUTPUT` and `scorefn batch merge INPUT OUTPUT [SHARD_FILE ...]` (docs/batch.md).

Exit status: 0 when every line of the shard is answered, or after SIGTERM once the lines in flight are written;
1 when a line could not be answered after every retry (a re-run goes on); 2 when the job cannot run as asked
(duplicate custom_ids, another job's OUTPUT, a bad shard); 3 when the model cannot start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from handler.batch.answering import GaveUp, RetryPolicy
from handler.batch.job import JobError, JobSpec, prepare, run
from handler.batch.lines import DuplicateIds
from handler.batch.local import LocalAnswerer
from handler.batch.merge import MergeError, merge
from handler.batch.remote import API_KEY_ENV, RemoteAnswerer
from handler.batch.shards import shard_of
from handler.lifecycle import EXIT_START_FAILED
from handler.logs import configure_logging
from runtime.settings import load_settings

log = logging.getLogger("scorefn.batch")
LOCAL_WINDOW, REMOTE_CONCURRENCY = 32, 8


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scorefn batch", description=(
        "Score an OpenAI batch file (JSONL: custom_id, method, url, body) into OUTPUT, one record per line. "
        "Re-running with the same OUTPUT goes on where it stopped. `scorefn batch merge INPUT OUTPUT` joins shards."))
    parser.add_argument("input", type=Path, metavar="INPUT")
    parser.add_argument("output", type=Path, metavar="OUTPUT")
    parser.add_argument("--url", help="a running scorefn to send the lines to (default: load the model here, "
                        f"as SCOREFN_* settings say); API key from {API_KEY_ENV}")
    parser.add_argument("--concurrency", type=int, help="lines in flight (default: "
                        f"{LOCAL_WINDOW} in process, {REMOTE_CONCURRENCY} requests with --url)")
    parser.add_argument("--shard", metavar="I/N", help="take lines i with i mod N == I and write "
                        "OUTPUT.shard-IIIII-of-NNNNN (default: CLOUD_RUN_TASK_INDEX/CLOUD_RUN_TASK_COUNT, or "
                        "JOB_COMPLETION_INDEX with --shards, else the whole file into OUTPUT)")
    parser.add_argument("--shards", type=int, metavar="N", help="the shard count of a Kubernetes Indexed Job "
                        "(its completions), with JOB_COMPLETION_INDEX")
    parser.add_argument("--max-tries", type=int, default=30, help="tries per line on 429, 502-504 and dropped "
                        "connections before the job stops with status 1 (default 30)")
    parser.add_argument("--progress", choices=("auto", "bar", "log"), default="auto",
                        help="a progress bar, or JSON log lines (default: a bar on a terminal)")
    parser.add_argument("--progress-interval", type=float, default=30.0, metavar="SECONDS",
                        help="between JSON progress lines (default 30)")
    return parser


def _merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scorefn batch merge", description=(
        "Join the shards' files into OUTPUT in input order and name the lines no shard answered (exit 1 then)."))
    parser.add_argument("input", type=Path, metavar="INPUT")
    parser.add_argument("output", type=Path, metavar="OUTPUT")
    parser.add_argument("files", type=Path, nargs="*", metavar="SHARD_FILE",
                        help="default: every OUTPUT.shard-*-of-* beside OUTPUT")
    return parser


def main(argv: list[str]) -> int:
    settings = load_settings()
    configure_logging(level=settings.log_level)
    logging.getLogger("scorefn.access").setLevel(logging.WARNING)  # a line per request: only the refused ones
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if argv[:1] == ["merge"]:
        return _merge(_merge_parser().parse_args(argv[1:]))
    return _run(_run_parser().parse_args(argv), settings)


def _merge(args: argparse.Namespace) -> int:
    try:
        merged = merge(args.input, args.output, args.files)
    except (MergeError, DuplicateIds, OSError) as exc:
        print(f"scorefn batch merge: {exc}", file=sys.stderr)
        return 2
    summary = merged.summary()
    log.info("batch merged" if not merged.missing else "batch merged, lines missing",
             extra={"json_fields": {"output": str(args.output), **summary}})
    return 1 if merged.missing else 0


def _run(args: argparse.Namespace, settings) -> int:
    stop = threading.Event()
    try:
        shard = shard_of(args.shard, args.shards, os.environ)
        concurrency = args.concurrency or (REMOTE_CONCURRENCY if args.url else LOCAL_WINDOW)
        if concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        # With --url a few lines more than the requests in flight wait their turn, so that a line retrying does
        # not leave the connections idle while the lines after it wait to be written in order.
        window = 4 * concurrency if args.url else concurrency
        bar = {"auto": None, "bar": True, "log": False}[args.progress]
        spec = JobSpec(args.input, args.output, shard, window, args.progress_interval, bar)
        prepared = prepare(spec)
    except (ValueError, JobError, DuplicateIds, OSError) as exc:
        print(f"scorefn batch: {exc}", file=sys.stderr)
        return 2
    _stop_on_signals(stop)
    retry = RetryPolicy(attempts=max(1, args.max_tries), stop=stop)
    if args.url:
        answerer = RemoteAnswerer(args.url, concurrency, retry, os.environ.get(API_KEY_ENV, ""))
    else:
        try:
            answerer = LocalAnswerer(settings, retry)
            start_s = answerer.start_engine()
        except Exception as exc:
            log.critical("engine start failed: %s: %s", type(exc).__name__, exc, exc_info=True)
            prepared.out.close()
            return EXIT_START_FAILED
        log.info("engine ready", extra={"json_fields": {"model": answerer.core.engine.model_id,
                                                        "start_s": round(start_s, 3)}})
    log.info("batch started", extra={"json_fields": {"input": str(args.input), "output": str(prepared.out.path),
                                                     "shard": str(shard), "lines": len(prepared.mine),
                                                     "answered_before": len(prepared.out.answered),
                                                     "mode": args.url or "in process"}})
    try:
        summary = run(prepared, answerer, stop)
    except GaveUp as exc:
        log.error("batch stopped: %s; re-run the same command to go on", exc)
        return 1
    log.info("batch stopped early; re-run the same command to go on" if summary["left"] else "batch done",
             extra={"json_fields": summary})
    return 0


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum: int, frame: object) -> None:
        if not stop.is_set():
            log.info("%s: finishing the lines in flight", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
