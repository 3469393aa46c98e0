"""Batch jobs run in this process on the fake engine (tests/handler/fake_engine.py): input files, runs, records."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from handler.batch.answering import RetryPolicy
from handler.batch.job import JobSpec, prepare, run
from handler.batch.local import LocalAnswerer
from handler.batch.shards import WHOLE, Shard
from tests.handler.conftest import make_settings
from tests.handler.fake_engine import FakeEngine


def score_line(custom_id: str, items: int = 2, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/score",
            "body": {"query": "q", "items": [f"item {i}" for i in range(items)], "label_token_ids": [3, 4], **body}}


def write_input(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def run_job(input_path: Path, output: Path, *, shard: Shard = WHOLE, window: int = 4, engine: FakeEngine | None = None,
            stop: threading.Event | None = None, retry: RetryPolicy | None = None) -> dict:
    stop = stop or threading.Event()
    engine = engine or FakeEngine()
    answerer = LocalAnswerer(make_settings(), retry or RetryPolicy(stop=stop), engine)
    answerer.start_engine()
    return run(prepare(JobSpec(input_path, output, shard, window, bar=False)), answerer, stop)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(record: dict) -> dict:
    """A record without what differs between runs: its id, the request's id, the body's id and time."""
    body = dict(record["response"]["body"])
    body.pop("id", None)
    body.pop("created", None)
    return {**record, "id": None, "response": {**record["response"], "request_id": None, "body": body}}
