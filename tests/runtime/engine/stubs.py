"""What the engine's stand-in scorers share: a cost the scheduler can plan with, one batch per job, and counters
(runtime.requests.scorer.RoundScorer: each stand-in adds dispatch and collect)."""

from __future__ import annotations

from runtime.requests.cost import Work
from runtime.requests.rounds import COUNTERS


class TokenCountCost:
    """A job costs one device batch and its tokens; any row count is worth a slice."""

    @staticmethod
    def cost(jobs, marginal: bool = False) -> Work:
        return Work(batches=len(jobs), full=sum(len(seq) for job in jobs for seq in job.sequences))

    @staticmethod
    def slice_rows(job) -> int:
        return 1

    @staticmethod
    def counters() -> dict[str, int]:
        return dict.fromkeys(COUNTERS, 0)
