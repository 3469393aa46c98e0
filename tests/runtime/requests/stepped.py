"""A scheduler (runtime.requests.scheduler) in stepped time: a stepped clock, a known service model, jobs of given
rows and tokens, and rounds that take their predicted time. No device, no sleeps."""

from __future__ import annotations

import dataclasses

from runtime.requests.cost import KINDS, ServiceModel, Work
from runtime.requests.scheduler import Scheduler
from runtime.requests.round_builder import ROUND_S

SECONDS_PER_TOKEN = dict.fromkeys(KINDS, 1 / 1024)  # binary fractions: exact sums


@dataclasses.dataclass(frozen=True)
class Job:
    sequences: list
    label_ids: tuple = (0,)


def job(rows: int, tokens: int = 10) -> Job:
    return Job([[1] * tokens] * rows)


def full_cost(job: Job) -> Work:
    return Work(batches=0, full=sum(map(len, job.sequences)))


def shared_cost(job: Job) -> Work:
    """As if every row shared a 50-token prefix and had 10 tokens after it."""
    return Work(batches=1, context=50) + Work(continuation=10) * len(job.sequences)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler(cost=full_cost, max_wait_s: float = 2.0, max_queue: int = 256, per_batch: float = 0.0
              ) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(ServiceModel(per_batch, SECONDS_PER_TOKEN), cost, max_queue, max_wait_s, ROUND_S[0],
                     clock=clock), clock


def run(s: Scheduler, clock: Clock) -> list[tuple[str | None, int, int]]:
    """Take one round and let it take its predicted time; its (request id, first row, end row) slices."""
    round = s.next_round()
    clock.now += round.predicted_s
    s.finish(round)
    return [(piece.entry.request_id, piece.start, piece.stop) for piece in round.slices]
