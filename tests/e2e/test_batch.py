"""`scorefn batch` as users run it, in real processes: in process and against a server (`--url`), two shards and
a merge, SIGKILL at random points and SIGTERM, and a server that refuses most requests."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess, scorefn_command
from tests.handler.batch.conftest import comparable, records

pytestmark = pytest.mark.slow
LINES = 24
TIMEOUT_S = 300


def batch_lines() -> list[str]:
    rng = random.Random(29)
    words = "the a river bank loan money water fish paper rock bird tree light stone".split()
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/score", "body": {
        "query": "Is this sentence about finance? ", "items": [" ".join(rng.choices(words, k=rng.randint(2, 12)))
                                                              for _ in range(rng.randint(1, 4))],
        "label_token_ids": [7042, 4528]}}) for i in range(LINES - 3)]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"custom_id": "rerank", "method": "POST", "url": "/v1/rerank",
                                "body": {"query": "bank loans", "documents": ["The bank lends money.", "Fish swim."]}}))
    lines.insert(14, json.dumps({"custom_id": "completion", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "The river bank", "max_tokens": 1, "logprobs": 3, "echo": True,
                                          "temperature": 0}}))
    return lines


@pytest.fixture(scope="module")
def input_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    path.write_text("\n".join(batch_lines()) + "\n")
    return path


def batch(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(scorefn_command("batch", *map(str, args)), env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finished(process: subprocess.Popen) -> tuple[int, list[dict]]:
    """(exit status, the JSON log lines) of a process run to its end."""
    out, _ = process.communicate(timeout=TIMEOUT_S)
    logged = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return process.returncode, logged


@pytest.fixture(scope="module")
def whole(input_path, server, tmp_path_factory) -> list[dict]:
    """One --url run of the whole file against the session's server: what every other run must equal."""
    output = tmp_path_factory.mktemp("whole") / "out.jsonl"
    status, logged = finished(batch(input_path, output, "--url", server.url))
    assert status == 0, logged[-5:]
    assert logged[-1]["message"] == "batch done" and logged[-1]["errors"] == {"invalid_json": 1}
    assert not logged[-1]["stopped"] and logged[-1]["left"] == 0
    return records(output)


def _as_whole(output: Path, whole: list[dict]) -> None:
    """Every line answered exactly once, as the whole run answered it."""
    got = records(output)
    assert sorted(str(r["custom_id"]) for r in got) == sorted(str(r["custom_id"]) for r in whole)
    by_id = {r["custom_id"]: comparable(r) for r in got}
    for record in whole:
        assert by_id[record["custom_id"]] == comparable(record), record["custom_id"]


def test_in_process_answers_as_the_server_does_bit_for_bit(input_path, whole, tmp_path):
    status, logged = finished(batch(input_path, tmp_path / "out.jsonl", env=SMALL_BUCKETS))
    assert status == 0, logged[-5:]
    summary = logged[-1]
    assert summary["message"] == "batch done" and summary["answered"] == LINES and summary["items_per_s"] > 0
    assert [r["custom_id"] for r in records(tmp_path / "out.jsonl")] == [r["custom_id"] for r in whole]
    _as_whole(tmp_path / "out.jsonl", whole)  # scores equal as JSON numbers: the same float32 bits


def test_two_shards_in_two_processes_merge_into_the_whole_run(input_path, whole, server, tmp_path):
    output = tmp_path / "out.jsonl"
    shards = [batch(input_path, output, "--url", server.url, env={"CLOUD_RUN_TASK_INDEX": str(i),
                                                                  "CLOUD_RUN_TASK_COUNT": "2"}) for i in range(2)]
    assert [finished(shard)[0] for shard in shards] == [0, 0]
    status, logged = finished(batch("merge", input_path, output))
    assert status == 0 and logged[-1]["written"] == LINES and logged[-1]["missing"] == 0
    assert [r["custom_id"] for r in records(output)] == [r["custom_id"] for r in whole]
    _as_whole(output, whole)


def test_shards_computed_in_their_own_processes_in_the_cpus_own_format_have_the_whole_runs_bits(
        input_path, tiny_llama_dir, tmp_path):
    """Each in-process run starts its own engine in the format its CPU class decides (SCOREFN_DTYPE auto: a fixed
    table, not a timing): two shards, each in its own process, merge into the bits of the whole file run in one (a
    tiny model: the processes, not the model, are what is shown)."""
    env = {**{k: v for k, v in SMALL_BUCKETS.items() if k != "SCOREFN_DTYPE"}, "SCOREFN_MODEL": str(tiny_llama_dir)}
    status, logged = finished(batch(input_path, tmp_path / "whole.jsonl", env=env))
    assert status == 0, logged[-5:]
    output = tmp_path / "out.jsonl"
    for i in range(2):
        assert finished(batch(input_path, output, "--shard", f"{i}/2", env=env))[0] == 0
    assert finished(batch("merge", input_path, output))[0] == 0
    _as_whole(output, records(tmp_path / "whole.jsonl"))


def _run_until(input_path: Path, output: Path, url: str, progress_lines: int, sig: signal.Signals) -> int:
    """Run --url with a progress line per answer; send `sig` after the `progress_lines`-th. Its exit status."""
    process = batch(input_path, output, "--url", url, "--concurrency", "2", "--progress", "log",
                    "--progress-interval", "0")
    seen = 0
    for line in process.stdout:
        seen += '"batch progress"' in line
        if seen == progress_lines:
            process.send_signal(sig)
            break
    return finished(process)[0]


def test_sigkill_at_random_points_and_reruns_lose_and_duplicate_nothing(input_path, whole, server, tmp_path):
    seed = random.randrange(1 << 30)
    points = sorted(random.Random(seed).sample(range(1, LINES), 3))
    output = tmp_path / "out.jsonl"
    done_before = 0
    for point in points:
        if done_before >= LINES - 1:  # the kill before came late enough to leave (almost) nothing to kill
            break
        # A kill lands a few answers after its progress line: the run before may have passed this point already.
        status = _run_until(input_path, output, server.url, max(1, point - done_before), signal.SIGKILL)
        assert status == -signal.SIGKILL, f"seed {seed}"
        done_before = len(output.read_bytes().splitlines())  # whole lines; a torn one is cut by the re-run
        assert done_before >= point, f"seed {seed}"
    status, logged = finished(batch(input_path, output, "--url", server.url))
    assert status == 0 and logged[-1]["left"] == 0, f"seed {seed}: {logged[-3:]}"
    _as_whole(output, whole)


def test_sigterm_writes_the_lines_in_flight_and_exits_0_and_a_rerun_finishes(input_path, whole, server, tmp_path):
    output = tmp_path / "out.jsonl"
    assert _run_until(input_path, output, server.url, 3, signal.SIGTERM) == 0
    first = records(output)  # every line whole: json.loads would fail on a torn one
    assert 3 <= len(first) < LINES
    status, logged = finished(batch(input_path, output, "--url", server.url))
    assert status == 0 and logged[-1]["answered_now"] == LINES - len(first)
    _as_whole(output, whole)


def test_against_a_server_that_refuses_most_requests_every_line_is_answered_once(input_path, whole, tmp_path):
    # A short wait and a queue of one: of 8 requests sent at once, all but about one are refused (429).
    refusing = {**SMALL_BUCKETS, "SCOREFN_MAX_WAIT_S": "0.05", "SCOREFN_MAX_QUEUE": "1"}
    with ServerProcess(env=refusing) as server:
        status, logged = finished(batch(input_path, tmp_path / "out.jsonl", "--url", server.url, "--concurrency", "8"))
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert status == 0, logged[-5:]
    refused = sum(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("scorefn_requests_total") and 'status="429"' in line)
    assert refused > 0  # the server did refuse: the job retried after each Retry-After
    _as_whole(tmp_path / "out.jsonl", whole)
