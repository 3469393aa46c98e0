"""Property tests of the core (Hypothesis, fake engine): whatever the body, a 2xx or a 4xx in the RFC-006
envelope; for valid requests, finite scores in range that do not depend on the order of the items."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handler.core import ScoringCore
from handler.http import HttpRequest, HttpResponse, PendingScore
from tests.handler.conftest import LIMITS, make_settings
from tests.handler.fake_engine import FakeEngine

FIELDS = ("query", "items", "label_token_ids", "apply_softmax", "item_first", "model")
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=5)
                           | st.dictionaries(st.text(max_size=10), children, max_size=5), max_leaves=20)
# Objects with the request's own field names, so that validation goes past the first checks.
request_like = st.dictionaries(st.sampled_from(FIELDS), json_values | st.lists(st.lists(st.integers(), max_size=4),
                                                                               max_size=4), max_size=6)


@pytest.fixture(scope="module")
def core() -> ScoringCore:
    engine = FakeEngine()
    engine.start()
    return ScoringCore(make_settings(), engine)


def call(core: ScoringCore, path: str, body: bytes) -> HttpResponse:
    outcome = core.begin(HttpRequest("POST", path, {"content-type": "application/json"}, body))
    if isinstance(outcome, PendingScore):
        outcome = core.finish(outcome, outcome.future.result(timeout=10))
    return outcome


def assert_ok_or_enveloped_client_error(response: HttpResponse) -> None:
    if response.status == 200:
        return
    assert 400 <= response.status < 500, response
    envelope = json.loads(response.body)
    assert set(envelope) == {"error"} and set(envelope["error"]) == {"message", "type", "param", "code"}
    assert isinstance(envelope["error"]["code"], str) and envelope["error"]["message"]


@PROPERTY_SETTINGS
@given(body=json_values | request_like, path=st.sampled_from(["/v1/score", "/v1/tokenize"]))
def test_any_json_body_gets_a_2xx_or_an_enveloped_4xx(core: ScoringCore, body: Any, path: str) -> None:
    assert_ok_or_enveloped_client_error(call(core, path, json.dumps(body).encode()))


@PROPERTY_SETTINGS
@given(body=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_get_a_2xx_or_an_enveloped_4xx(core: ScoringCore, body: bytes) -> None:
    assert_ok_or_enveloped_client_error(call(core, "/v1/score", body))


# Valid requests within the limits: one token per character (+ BOS), so at most 8 items x 31 tokens <= 300.
texts = st.text(st.characters(codec="utf-8"), max_size=15)
token_lists = st.lists(st.integers(0, FakeEngine.vocab_size - 1), max_size=15)
assert LIMITS["max_items"] * 31 <= LIMITS["max_total_tokens"]


@st.composite
def valid_requests(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        query, items = draw(texts.filter(bool)), draw(st.lists(texts, min_size=1, max_size=LIMITS["max_items"]))
    else:
        query = draw(token_lists.filter(bool))
        items = draw(st.lists(token_lists, min_size=1, max_size=LIMITS["max_items"]))
    labels = draw(st.lists(st.integers(0, FakeEngine.vocab_size - 1), min_size=1, max_size=LIMITS["max_labels"]))
    return {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": draw(st.booleans()),
            "item_first": draw(st.booleans())}


@PROPERTY_SETTINGS
@given(request=valid_requests(), data=st.data())
def test_valid_requests_score_finite_in_range_and_independent_of_item_order(
        core: ScoringCore, request: dict[str, Any], data: st.DataObject) -> None:
    response = call(core, "/v1/score", json.dumps(request).encode())
    assert response.status == 200, response.body
    scores = json.loads(response.body)["scores"]
    assert len(scores) == len(request["items"])
    for row in scores:
        assert len(row) == len(request["label_token_ids"])
        assert all(math.isfinite(value) for value in row)
        if request["apply_softmax"]:
            assert all(0.0 <= value <= 1.0 for value in row) and math.isclose(sum(row), 1.0, rel_tol=1e-9)
        else:
            assert all(value <= 0.0 for value in row)

    order = data.draw(st.permutations(range(len(request["items"]))))
    shuffled = {**request, "items": [request["items"][i] for i in order]}
    reply = call(core, "/v1/score", json.dumps(shuffled).encode())
    assert reply.status == 200
    assert json.loads(reply.body)["scores"] == [scores[i] for i in order]
