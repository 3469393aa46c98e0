"""The batch loop: a shard's unanswered lines through an answerer, a window of them in flight, each answer written
in input order as soon as the lines before it are written.

`stop` (set on SIGTERM or SIGINT) ends the reading of new lines: the lines in flight finish and are written, a line
still waiting to be retried stays unanswered, and a re-run goes on from there.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from pathlib import Path

from handler.batch.answering import Answerer, Done, GaveUp, Ticket
from handler.batch.lines import Refusal, Request, key_of, keys, parse, read_lines
from handler.batch.progress import Progress
from handler.batch.records import OutputFile, record, refused
from handler.batch.shards import Shard

SYNC_EVERY_S = 10.0  # how much a lost machine (not a killed process) may have to redo


class JobError(Exception):
    """The job cannot run as asked (the message says why); nothing was answered."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    input: Path
    output: Path  # the whole job's OUTPUT; a shard writes beside it (Shard.output)
    shard: Shard
    window: int  # lines in flight
    progress_interval_s: float = 30.0
    bar: bool | None = None  # None: a bar when stderr is a terminal


@dataclasses.dataclass
class Prepared:
    """A job checked and its output opened: what is left to do is known before any model loads."""
    spec: JobSpec
    mine: set  # the keys of the shard's lines
    out: OutputFile


def prepare(spec: JobSpec) -> Prepared:
    """Read the input's custom_ids (DuplicateIds) and open the shard's output to go on (JobError)."""
    if not spec.input.is_file():
        raise JobError(f"INPUT {spec.input} is not a file")
    mine = {key for index, key in enumerate(keys(spec.input)) if spec.shard.holds(index)}
    try:
        out = OutputFile(spec.shard.output(spec.output))
    except (OSError, ValueError) as exc:
        raise JobError(str(exc)) from None
    strangers = out.answered - mine
    if strangers:
        out.close()
        raise JobError(f"{out.path} answers lines that shard {spec.shard} of {spec.input} does not hold (e.g. "
                       f"{sorted(map(str, strangers))[0]!r}): is it another job's output? Give another OUTPUT.")
    return Prepared(spec, mine, out)


def run(prepared: Prepared, answerer: Answerer, stop: threading.Event) -> dict:
    """Answer the shard's lines not yet in its output; the closing summary (progress fields, `stopped`, `left`)."""
    spec, mine, out = prepared.spec, prepared.mine, prepared.out
    progress = Progress(len(mine), len(out.answered), spec.progress_interval_s, spec.bar)
    window: collections.deque[tuple[Request | Refusal, Ticket]] = collections.deque()
    writer = _Writer(out, progress)
    try:
        for line in read_lines(spec.input):
            if stop.is_set():
                break
            if not spec.shard.holds(line.index):
                continue
            key = key_of(line)
            if key in out.answered:
                continue
            parsed = parse(line, key)
            window.append((parsed, Done(refused(parsed)) if isinstance(parsed, Refusal) else answerer.start(parsed)))
            while len(window) >= spec.window:
                writer.write(*window.popleft())
        stopped = stop.is_set()  # before the answerer closes (closing sets it, to end any retry's wait)
    except GaveUp:
        stop.set()
        raise
    finally:
        try:
            while window:  # the lines in flight: finished and written (stopping or not)
                writer.write(*window.popleft())
        finally:
            answerer.close()
            out.close()
    summary = progress.close()
    return {**summary, "output": str(out.path), "shard": str(spec.shard), "redone_torn_bytes": out.cut_bytes,
            "stopped": stopped, "left": summary["lines"] - summary["answered"]}


class _Writer:
    def __init__(self, out: OutputFile, progress: Progress) -> None:
        self._out, self._progress = out, progress
        self._synced = time.monotonic()

    def write(self, line: Request | Refusal, ticket: Ticket) -> None:
        answer = ticket.result()
        if answer is None:  # stopping: it stays for the next run
            return
        data, error = record(line.key, answer)
        self._out.write(data)
        self._progress.answered(line.items if isinstance(line, Request) else 0, error)
        if time.monotonic() - self._synced > SYNC_EVERY_S:
            self._out.sync()
            self._synced = time.monotonic()
