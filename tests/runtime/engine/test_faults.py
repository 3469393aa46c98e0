"""A fault in one device round fails only that round's requests (500 internal_error, logged with their request
IDs), a non-finite result fails only its own request, and the engine keeps serving.

The real runtime.engine.Engine (queue, device thread, coalescing) runs a stub scorer, so nothing compiles;
requests go through the real handler core.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from handler.core import ScoringCore
from runtime.interface import EngineError
from handler.http import HttpRequest, HttpResponse, PendingScore
from runtime.assembly.compose import bucket_plan
from runtime.engine import Engine
from runtime.assembly.platform import resolve
from runtime.settings import load_settings
from tests.runtime.engine.stubs import TokenCountCost

POISON = 666  # a device round holding this token raises
NAN_TOKEN = 777  # a sequence holding this token scores NaN
WAIT_S = 30.0


class StubScorer(TokenCountCost):
    """Like runtime.requests.scorer.Scorer's dispatch/collect: one [n_sequences, n_labels] array per job. Can hold a
    round (in dispatch, as a busy device would hold the next one)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a round starts
        self.rounds: list[list[list[list[int]]]] = []  # per round: each job's sequences
        settings = load_settings(environ={})
        self.plan = bucket_plan(settings, resolve(settings, backend="cpu"))

    def collect(self, results: list[np.ndarray]) -> list[np.ndarray]:
        return results

    def dispatch(self, jobs) -> list[np.ndarray]:
        self.rounds.append([list(job.sequences) for job in jobs])
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if any(POISON in sequence for job in jobs for sequence in job.sequences):
            raise RuntimeError("injected device fault")
        results = []
        for job in jobs:
            logprobs = np.full((len(job.sequences), len(job.label_ids)), -1.5, np.float32)
            for row, sequence in enumerate(job.sequences):
                if NAN_TOKEN in sequence:
                    logprobs[row, 0] = np.nan
            results.append(logprobs)
        return results


@pytest.fixture
def stub() -> StubScorer:
    return StubScorer()


@pytest.fixture
def core(stub: StubScorer) -> Iterator[ScoringCore]:
    settings = load_settings(environ={}, batch_wait_ms=50.0)
    engine = Engine(settings)
    engine.vocab_size = 1000  # what start() reads from the model
    engine.start_with(stub)
    yield ScoringCore(settings, engine)
    engine.stop(1.0)


def post(core: ScoringCore, request_id: str, tokens: list[int]) -> PendingScore:
    body = json.dumps({"query": tokens, "items": [[5], [6, 7]], "label_token_ids": [3, 4]}).encode()
    outcome = core.begin(HttpRequest("POST", "/v1/score", {"x-request-id": request_id}, body))
    assert isinstance(outcome, PendingScore), outcome
    return outcome


def finish(core: ScoringCore, pending: PendingScore) -> HttpResponse:
    try:
        result = pending.future.result(WAIT_S)
    except EngineError as exc:  # the engine's verdict, handed to the core as the faces do
        return core.finish(pending, exc)
    return core.finish(pending, result)


def assert_internal_error(response: HttpResponse, request_id: str) -> None:
    assert response.status == 500
    assert json.loads(response.body) == {"error": {"message": "An internal error occurred. Please try again.",
                                                   "type": "server_error", "param": None, "code": "internal_error"}}
    assert ("x-request-id", request_id) in response.headers


def assert_scored(response: HttpResponse) -> None:
    assert response.status == 200, response.body
    assert json.loads(response.body)["scores"] == [[-1.5, -1.5], [-1.5, -1.5]]


def one_round(core: ScoringCore, stub: StubScorer, queries: dict[str, list[int]]) -> dict[str, HttpResponse]:
    """Hold the device on a first request, queue `queries` behind it, release: they form one device round."""
    stub.gate.clear()
    stub.entered.clear()
    first = post(core, "first", [10, 11])
    assert stub.entered.wait(WAIT_S)
    pending = {request_id: post(core, request_id, tokens) for request_id, tokens in queries.items()}
    stub.gate.set()
    assert_scored(finish(core, first))
    responses = {request_id: finish(core, p) for request_id, p in pending.items()}
    assert len(stub.rounds[-1]) == len(queries), "the queued requests were not coalesced into one round"
    return responses


def test_a_failing_device_round_fails_only_its_requests(core: ScoringCore, stub: StubScorer,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="scorefn")
    responses = one_round(core, stub, {"good-1": [20, 21], "poisoned": [POISON, 21], "good-2": [22]})
    for request_id, response in responses.items():  # one round: they share its fate
        assert_internal_error(response, request_id)

    # the engine keeps serving: the next rounds are fine
    assert_scored(finish(core, post(core, "after", [30, 31])))
    assert_scored(finish(core, post(core, "after-2", [32])))
    assert core.engine.ready

    failures = [r for r in caplog.records if r.name == "scorefn.runtime" and "device round" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None  # with the traceback
    # in the round's order: shortest work first (good-2 has one token), then first come, first served
    assert failures[0].json_fields == {"request_ids": ["good-2", "good-1", "poisoned"]}
    assert "good-2, good-1, poisoned" in failures[0].getMessage()
    assert not any("after" in r.getMessage() for r in caplog.records)


def test_non_finite_scores_fail_only_their_request(core: ScoringCore, stub: StubScorer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="scorefn")
    responses = one_round(core, stub, {"good-1": [20, 21], "nan": [NAN_TOKEN], "good-2": [22]})
    assert_scored(responses["good-1"])
    assert_scored(responses["good-2"])
    assert_internal_error(responses["nan"], "nan")
    assert_scored(finish(core, post(core, "after", [30, 31])))

    non_finite = [r for r in caplog.records if r.name == "scorefn.runtime" and "non-finite" in r.getMessage()]
    assert len(non_finite) == 1 and non_finite[0].json_fields == {"request_ids": ["nan"]}
    handler_errors = [r for r in caplog.records if r.name == "scorefn.handler"]
    assert [r.getMessage() for r in handler_errors] == ["request nan: scoring failed"]
