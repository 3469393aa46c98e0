"""Shards: which lines each takes, from the flags or a job's environment; merging their files; progress lines."""

from __future__ import annotations

import io
import json
import logging

import pytest

from handler.batch.merge import MergeError, merge
from handler.batch.progress import Progress
from handler.batch.shards import Shard, shard_of
from tests.handler.batch.conftest import comparable, records, run_job, score_line, write_input


@pytest.mark.parametrize("given, shards, environ, expected", [
    (None, None, {}, Shard(0, 1)),
    ("2/4", None, {"CLOUD_RUN_TASK_INDEX": "1", "CLOUD_RUN_TASK_COUNT": "3"}, Shard(2, 4)),  # the flag wins
    (None, None, {"CLOUD_RUN_TASK_INDEX": "1", "CLOUD_RUN_TASK_COUNT": "3"}, Shard(1, 3)),
    (None, 5, {"JOB_COMPLETION_INDEX": "4"}, Shard(4, 5)),
])
def test_the_shard_comes_from_the_flag_or_the_job_environment(given, shards, environ, expected):
    assert shard_of(given, shards, environ) == expected


@pytest.mark.parametrize("given, shards, environ, message", [
    ("3/3", None, {}, "shard 3 of 3 does not exist"),
    ("1-of-2", None, {}, "give INDEX/COUNT"),
    (None, None, {"JOB_COMPLETION_INDEX": "0"}, "give --shards"),
    (None, None, {"CLOUD_RUN_TASK_INDEX": "0"}, "CLOUD_RUN_TASK_COUNT='' is not a whole number"),
    (None, 4, {}, "--shards needs JOB_COMPLETION_INDEX"),
])
def test_a_shard_that_cannot_be_is_refused_saying_why(given, shards, environ, message):
    with pytest.raises(ValueError, match=message):
        shard_of(given, shards, environ)


def test_shards_take_every_line_once_and_merge_into_the_whole_run_in_input_order(tmp_path):
    lines = [score_line(f"r{i}", items=1 + i % 4) for i in range(10)] + ["not json", score_line("last")]
    path = write_input(tmp_path / "in.jsonl", [lines[0], "", *lines[1:]])  # a blank line is no request
    run_job(path, tmp_path / "whole.jsonl")
    for index in range(3):
        summary = run_job(path, tmp_path / "out.jsonl", shard=Shard(index, 3))
        assert summary["lines"] == 4
    shard_lines = [records(tmp_path / f"out.jsonl.shard-{i:05d}-of-00003") for i in range(3)]
    assert [r["custom_id"] for r in shard_lines[1]] == ["r1", "r4", "r7", None]  # line index 10 is "not json"
    merged = merge(path, tmp_path / "out.jsonl")
    assert merged.written == merged.lines == 12 and merged.missing == []
    assert list(map(comparable, records(tmp_path / "out.jsonl"))) == list(map(comparable,
                                                                               records(tmp_path / "whole.jsonl")))


def test_merge_names_the_lines_no_shard_answered(tmp_path):
    path = write_input(tmp_path / "in.jsonl", [score_line(f"r{i}") for i in range(6)] + ["{"])
    for index in (0, 2):  # shard 1 of 3 never ran
        run_job(path, tmp_path / "out.jsonl", shard=Shard(index, 3))
    merged = merge(path, tmp_path / "out.jsonl")
    assert merged.summary()["missing_custom_ids"] == ["r1", "r4"] and merged.written == 5
    assert [r["custom_id"] for r in records(tmp_path / "out.jsonl")] == ["r0", "r2", "r3", "r5", None]


def test_merge_refuses_files_of_another_input(tmp_path):
    path = write_input(tmp_path / "in.jsonl", [score_line("a")])
    other = write_input(tmp_path / "other.jsonl", [score_line("b"), score_line("c")])
    run_job(other, tmp_path / "out.jsonl", shard=Shard(0, 2))
    with pytest.raises(MergeError, match="another job's output"):
        merge(path, tmp_path / "out.jsonl")
    with pytest.raises(MergeError, match="no shard files"):
        merge(path, tmp_path / "none.jsonl")


def test_progress_is_a_json_line_per_interval_off_a_terminal_and_a_bar_on_one(caplog):
    caplog.set_level(logging.INFO, logger="scorefn.batch")
    progress = Progress(total=4, done_before=1, interval_s=0.0, bar=False)
    progress.answered(items=3, error=None)
    progress.answered(items=0, error="invalid_json")
    fields = [record.json_fields for record in caplog.records if record.getMessage() == "batch progress"]
    assert len(fields) == 2 and fields[-1]["answered"] == 3 and fields[-1]["errors"] == {"invalid_json": 1}
    assert json.dumps(fields[-1])  # what the JSON formatter prints
    stream = io.StringIO()
    bar = Progress(total=4, done_before=1, interval_s=0.0, bar=True, stream=stream)
    bar.answered(items=3, error=None)
    assert bar.close()["items"] == 3 and "2/4" in stream.getvalue() and "items/s" in stream.getvalue()
