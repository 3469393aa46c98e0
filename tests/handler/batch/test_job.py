"""`scorefn batch`'s job in process on the fake engine: records, bad lines, resume after a stop or a crash."""

from __future__ import annotations

import json
import threading

import pytest

from handler.batch.answering import GaveUp, RetryPolicy
from handler.batch.job import JobError
from handler.batch.lines import DuplicateIds
from runtime.interface import QueueFull
from tests.handler.batch.conftest import comparable, records, run_job, score_line, write_input
from tests.handler.conftest import make_settings, serve
from tests.handler.fake_engine import FakeEngine, expected_logprob

COMPLETION = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hello", "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}}


def test_every_line_gets_what_its_endpoint_answers_over_http_in_input_order(tmp_path):
    lines = [score_line(f"s{i}", items=i + 1) for i in range(6)] + [COMPLETION]
    summary = run_job(write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", window=3)
    out = records(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines]
    assert summary["answered"] == summary["lines"] == 7 and summary["items"] == 21 + 1 and summary["errors"] == {}
    assert not summary["stopped"] and summary["left"] == 0
    engine = FakeEngine()
    with serve("wsgi", make_settings(), engine) as client:
        for line, record in zip(lines, out):
            response = client.post(line["url"], json=line["body"])
            assert record["response"]["status_code"] == response.status == 200
            assert record["error"] is None and record["id"].startswith("batch_req_")
            assert comparable(record)["response"]["body"] == comparable(
                {"response": {"body": response.json()}})["response"]["body"]
    # BOS + "q" + "item 0": 8 tokens
    assert out[0]["response"]["body"]["scores"] == [pytest.approx([expected_logprob(8, 3), expected_logprob(8, 4)])]


BAD_LINES = [
    ("not json", "invalid_json", 400, None),
    ("[1, 2]", "invalid_body_type", 400, None),
    (json.dumps({"method": "POST", "url": "/v1/score", "body": {}}), "invalid_request", 400, None),
    (json.dumps({**score_line("m"), "method": "GET"}), "method_not_allowed", 405, "m"),
    (json.dumps({**score_line("u"), "url": "/v1/tokenize"}), "not_found", 404, "u"),
    (json.dumps({**score_line("b"), "body": [1]}), "invalid_body_type", 400, "b"),
    (json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/score"}), "invalid_json", 400, "e"),
    (json.dumps(score_line("i", query="")), "empty_query", 400, "i"),
    (json.dumps(score_line("v", label_token_ids=[5000])), "token_id_exceeds_vocab", 422, "v"),
]


@pytest.mark.parametrize("line, code, status, custom_id", BAD_LINES, ids=[case[1] + "-" + str(case[3])
                                                                        for case in BAD_LINES])
def test_each_kind_of_bad_line_gets_an_error_line_and_the_job_goes_on(tmp_path, line, code, status, custom_id):
    path = write_input(tmp_path / "in.jsonl", [score_line("before"), line, score_line("after")])
    summary = run_job(path, tmp_path / "out.jsonl")
    before, bad, after = records(tmp_path / "out.jsonl")
    assert before["error"] is None and after["error"] is None
    assert bad["custom_id"] == custom_id and bad["response"]["status_code"] == status
    assert bad["error"]["code"] == bad["response"]["body"]["error"]["code"] == code
    assert ("line" in bad) == (custom_id is None) and bad.get("line", 2) == 2
    assert summary["errors"] == {code: 1}


def test_duplicate_custom_ids_are_refused_before_anything_runs_naming_the_first_two(tmp_path):
    lines = [score_line("a"), score_line("b"), score_line("a"), score_line("b"), score_line("a")]
    with pytest.raises(DuplicateIds, match=r"'a' on lines 1 and 3; 'b' on lines 2 and 4"):
        run_job(write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.fixture
def whole(tmp_path):
    """(input, a whole run's output lines) of 12 lines."""
    path = write_input(tmp_path / "in.jsonl", [score_line(f"r{i}", items=1 + i % 3) for i in range(12)] + ["bad"])
    run_job(path, tmp_path / "whole.jsonl")
    return path, (tmp_path / "whole.jsonl").read_bytes().splitlines(keepends=True)


def _assert_once_each(output, whole_lines):
    got = [comparable(json.loads(line)) for line in output.read_bytes().splitlines()]
    assert sorted(map(json.dumps, got)) == sorted(json.dumps(comparable(json.loads(line))) for line in whole_lines)


def test_a_rerun_keeps_what_is_answered_and_answers_the_rest(tmp_path, whole):
    path, lines = whole
    output = tmp_path / "out.jsonl"
    output.write_bytes(b"".join(lines[:5]))
    summary = run_job(path, output)
    assert output.read_bytes().startswith(b"".join(lines[:5]))
    assert summary["answered_now"] == 8 and summary["left"] == 0
    _assert_once_each(output, lines)


def test_a_torn_last_line_is_cut_and_its_line_answered_again(tmp_path, whole):
    path, lines = whole
    output = tmp_path / "out.jsonl"
    output.write_bytes(b"".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    summary = run_job(path, output)
    assert summary["redone_torn_bytes"] == len(lines[5]) // 2 and summary["answered_now"] == 8
    _assert_once_each(output, lines)


def test_a_bad_line_before_the_last_refuses_the_output(tmp_path, whole):
    path, lines = whole
    output = tmp_path / "out.jsonl"
    output.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(JobError, match="line 2 is not an output record"):
        run_job(path, output)
    assert output.read_bytes() == lines[0] + b"garbage\n" + lines[1]


def test_another_jobs_output_is_refused(tmp_path, whole):
    path, lines = whole
    other = write_input(tmp_path / "other.jsonl", [score_line("x")])
    run_job(other, tmp_path / "other-out.jsonl")
    with pytest.raises(JobError, match="another job's output"):
        run_job(path, tmp_path / "other-out.jsonl")


def test_a_stop_finishes_the_lines_in_flight_and_leaves_the_rest_to_a_rerun(tmp_path, whole):
    path, lines = whole
    engine, stop, output = FakeEngine(), threading.Event(), tmp_path / "out.jsonl"
    engine.hold = True
    summaries = []
    job = threading.Thread(target=lambda: summaries.append(run_job(path, output, window=4, engine=engine, stop=stop)))
    job.start()
    while len(engine.held) < 4:  # the window is full: the job waits on its first line
        assert engine.submitted.wait(10)
        engine.submitted.clear()
    stop.set()  # as SIGTERM does
    for future in engine.held:
        future.set_result(engine.compute(*engine.submissions[engine.held.index(future)][:2]))
    job.join(10)
    (summary,) = summaries
    assert summary["stopped"] and summary["answered"] == 4 and summary["left"] == 9
    assert len(engine.submissions) == 4  # no line read after the stop
    run_job(path, output)
    _assert_once_each(output, lines)


class RefusingEngine(FakeEngine):
    """Refuses (429) the first `refusals` submissions."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def submit(self, *args, **kwargs):
        if self.refusals:
            self.refusals -= 1
            raise QueueFull("the queue is full", retry_after_s=1)
        return super().submit(*args, **kwargs)


def test_a_refused_line_is_sent_again_until_answered(tmp_path, whole):
    path, lines = whole
    engine = RefusingEngine(refusals=5)
    run_job(path, tmp_path / "out.jsonl", engine=engine, retry=RetryPolicy(cap_s=0.001))
    _assert_once_each(tmp_path / "out.jsonl", lines)
    assert engine.refusals == 0


def test_a_line_refused_every_time_stops_the_job_with_what_came_before_written(tmp_path, whole):
    path, lines = whole
    engine = RefusingEngine(refusals=2)  # the first line's two tries
    with pytest.raises(GaveUp, match="line 1: still 429 after 2 tries"):
        run_job(path, tmp_path / "out.jsonl", engine=engine, window=1, retry=RetryPolicy(attempts=2, cap_s=0.001))
    assert records(tmp_path / "out.jsonl") == []
