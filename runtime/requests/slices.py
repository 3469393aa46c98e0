"""What the scheduler (runtime.requests.scheduler) holds: an admitted request and how far it has got, the slices of it
that a device round computes, and the rounds. Pure Python."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from runtime.requests.cost import Work


@dataclasses.dataclass(frozen=True)
class Admission:
    """What admission predicted for a request: its own device seconds, its wait for the device, and the instance's
    offered load (device seconds asked for per second) when it arrived."""
    own_s: float
    wait_s: float
    load: float


@dataclasses.dataclass(eq=False)
class Entry:
    """An admitted request: its job, what a slice of it costs, and how far it has got."""
    job: Any  # runtime.requests.scorer's Job or TokenJob
    deadline: float | None  # time.monotonic() after which it is dropped if not started
    request_id: str | None
    shared: Work  # paid by every slice: a shared prefix's context (empty when the rows stand alone)
    per_row: Work  # each row's share of the rest
    submitted: float = 0.0
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    next_row: int = 0  # rows [0, next_row) are dispatched
    started: bool = False  # its first slice is taken (its future is running)
    admission: Admission | None = None  # set when admitted
    min_rows: int = 1  # the fewest rows worth a slice of their own (a shared prefix's first device batch)
    parts: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # (first row, a slice's result)
    rows_done: int = 0
    device_s: float = 0.0  # seconds of the rounds that carried its slices
    cached_tokens: int = 0  # of its rows' tokens, those the prefix cache held (the scorer's Dispatched says)
    trace: Any = None  # its spans while tracing is on (runtime.requests.spans.RequestTrace)
    left_cache: tuple | None = None  # ((next_row, the model's rounds), predicted seconds left): Backlog.left_s's

    @property
    def rows(self) -> int:
        return len(self.job.sequences)

    @property
    def rows_left(self) -> int:
        return self.rows - self.next_row

    def left(self) -> Work:
        return self.shared + self.per_row * self.rows_left if self.rows_left else Work()

    def add(self, start: int, result: Any, seconds: float) -> bool:
        """A slice's result; True once every row has one."""
        self.parts.append((start, result))
        self.rows_done += len(result)
        self.device_s += seconds
        return self.rows_done == self.rows

    def results(self) -> list:
        return [result for _, result in sorted(self.parts, key=lambda part: part[0])]


@dataclasses.dataclass(eq=False)
class Slice:
    """Rows [start, stop) of an entry, computed in one round."""
    entry: Entry
    start: int
    stop: int

    @property
    def work(self) -> Work:
        return self.entry.shared + self.entry.per_row * (self.stop - self.start)

    @property
    def job(self) -> Any:
        job = self.entry.job
        if self.start == 0 and self.stop == self.entry.rows:
            return job
        changes = {"sequences": job.sequences[self.start:self.stop]}
        if hasattr(job, "sampling"):  # a TokenJob: one Sampling per sequence
            changes["sampling"] = job.sampling[self.start:self.stop]
        elif getattr(job, "targets", None) is not None:  # a Job of labels of several tokens: one label a row
            changes["targets"] = job.targets[self.start:self.stop]
        return dataclasses.replace(job, **changes)


@dataclasses.dataclass(eq=False)
class Round:
    slices: list[Slice]
    work: Work
    predicted_s: float
    started: float  # when its device work began: dispatch, or the end of the round before it when pipelined
    number: int = 0  # rounds are numbered from 1 (traces and logs name them)
    dispatched: Any = None  # the scorer's handle
    error: Exception | None = None
