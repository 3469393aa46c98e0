"""Which lines a shard takes: line i (counting requests, blank lines skipped) goes to shard i mod N.

The shard is `--shard I/N`, or Cloud Run Jobs' CLOUD_RUN_TASK_INDEX / CLOUD_RUN_TASK_COUNT, or a Kubernetes Indexed
Job's JOB_COMPLETION_INDEX with `--shards N` (its completions; Kubernetes does not pass the count). Each shard
writes its own file beside OUTPUT; `scorefn batch merge` joins them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def holds(self, line_index: int) -> bool:
        return line_index % self.count == self.index

    def output(self, output: Path) -> Path:
        """The file this shard writes: OUTPUT itself when the job is one shard."""
        if self.count == 1:
            return output
        return output.with_name(f"{output.name}.shard-{self.index:05d}-of-{self.count:05d}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


WHOLE = Shard(0, 1)
SHARD_FILE = re.compile(r"\.shard-(\d{5})-of-(\d{5})$")


def shard_of(given: str | None, shards: int | None, environ: Mapping[str, str]) -> Shard:
    """The job's shard from the flags, else the environment; ValueError says what is wrong."""
    if given is not None:
        match = re.fullmatch(r"(\d+)/(\d+)", given.strip())
        if not match:
            raise ValueError(f"--shard {given!r}: give INDEX/COUNT, e.g. 0/4")
        return _checked(int(match[1]), int(match[2]), "--shard")
    if "CLOUD_RUN_TASK_INDEX" in environ:
        return _checked(_int(environ, "CLOUD_RUN_TASK_INDEX"), _int(environ, "CLOUD_RUN_TASK_COUNT"),
                        "CLOUD_RUN_TASK_INDEX/CLOUD_RUN_TASK_COUNT")
    if "JOB_COMPLETION_INDEX" in environ:
        if shards is None:
            raise ValueError("JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job): give --shards with the "
                             "Job's completions")
        return _checked(_int(environ, "JOB_COMPLETION_INDEX"), shards, "JOB_COMPLETION_INDEX/--shards")
    if shards not in (None, 1):
        raise ValueError("--shards needs JOB_COMPLETION_INDEX (a Kubernetes Indexed Job); elsewhere use --shard I/N")
    return WHOLE


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "")
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r} is not a whole number")
    return int(value)


def _checked(index: int, count: int, where: str) -> Shard:
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"{where}: shard {index} of {count} does not exist (0 <= index < count)")
    return Shard(index, count)
