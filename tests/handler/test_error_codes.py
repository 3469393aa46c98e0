"""Every error code of handler.errors.ERRORS, produced over HTTP on both faces, with its table status and type."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.interface import DeadlineExceeded, EngineFault, QueueFull, ShuttingDown
from handler.errors import ENGINE_ERRORS, ERRORS, INTERNAL_ERROR_MESSAGE, ErrorSpec
from tests.handler.clients import Reply
from tests.handler.conftest import FACES, make_settings, score_body, serve
from tests.handler.fake_classifiers import HEAD, SENTIMENT, TOPIC
from tests.handler.fake_engine import FakeEngine
from tests.handler.fake_rerankers import RELEVANCE

# RFC-006 rows that DESIGN.md makes unreachable (model is optional; the one model is always loaded).
RESERVED = {"missing_model", "model_not_loaded"}


def _score(body: Any = None, *, content: bytes | None = None, headers: dict[str, str] | None = None,
           setup: Callable[[FakeEngine], None] | None = None, wait_ready: bool = True,
           **settings: Any) -> Callable[[str, FakeEngine], Reply]:
    def run(face: str, engine: FakeEngine) -> Reply:
        if setup is not None:
            setup(engine)
        with serve(face, make_settings(**settings), engine, wait_ready=wait_ready) as client:
            return client.post("/v1/score", json=body, content=content, headers=headers)
    return run


def _request(method: str, path: str, body: Any = None, **settings: Any) -> Callable[[str, FakeEngine], Reply]:
    def run(face: str, engine: FakeEngine) -> Reply:
        with serve(face, make_settings(**settings), engine) as client:
            return client.request(method, path, json=body)
    return run


def _gate(engine: FakeEngine) -> None:
    engine.start_gate.clear()


def _set(attribute: str, value: Any) -> Callable[[FakeEngine], None]:
    return lambda engine: setattr(engine, attribute, value)


def _empty_tokenizer(engine: FakeEngine) -> None:
    engine.tokenize = lambda text, add_special_tokens=True: []  # type: ignore[method-assign]


def _classify(body: Any, task: str = "causal_lm", path: str = "/v1/classify") -> Callable[[str, FakeEngine], Reply]:
    """POST to a fake engine serving the fake verbalizer classifiers (or, for a classification model, a head)."""
    def run(face: str, engine: FakeEngine) -> Reply:
        engine.task = task
        engine.classifiers = (HEAD,) if task == "sequence_classification" else (SENTIMENT, TOPIC)
        with serve(face, make_settings(), engine) as client:
            return client.post(path, json=body)
    return run


def _rerank(body: Any, path: str = "/v1/rerank") -> Callable[[str, FakeEngine], Reply]:
    """POST to a fake engine serving a fake verbalizer reranker."""
    def run(face: str, engine: FakeEngine) -> Reply:
        engine.rerankers = (RELEVANCE,)
        with serve(face, make_settings(), engine) as client:
            return client.post(path, json=body)
    return run


def _complete(body: Any) -> Callable[[str, FakeEngine], Reply]:
    def run(face: str, engine: FakeEngine) -> Reply:
        with serve(face, make_settings(), engine) as client:
            return client.post("/v1/completions", json=body)
    return run


def _prompt(**fields: Any) -> dict[str, Any]:
    return {"prompt": "abc", "max_tokens": 1, **fields}


# code -> (how to produce it, expected param)
CASES: dict[str, tuple[Callable[[str, FakeEngine], Reply], str | None]] = {
    "missing_query": (_score(score_body(query=...)), "query"),
    "empty_query": (_score(score_body(query="")), "query"),
    "invalid_query_type": (_score(score_body(query=5)), "query"),
    "missing_items": (_score(score_body(items=...)), "items"),
    "empty_items": (_score(score_body(items=[])), "items"),
    "invalid_items_type": (_score(score_body(items="abc")), "items"),
    "mixed_input_types": (_score(score_body(items=[[1, 2]])), "items"),
    "missing_label_token_ids": (_score(score_body(label_token_ids=...)), "label_token_ids"),
    "empty_label_token_ids": (_score(score_body(label_token_ids=[])), "label_token_ids"),
    "negative_token_id": (_score(score_body(label_token_ids=[5, -1])), "label_token_ids"),
    "token_id_exceeds_vocab": (_score(score_body(label_token_ids=[5, 1000])), "label_token_ids"),
    "invalid_label_token_ids_type": (_score(score_body(label_token_ids=7)), "label_token_ids"),
    "invalid_token_id_type": (_score(score_body(label_token_ids=[7, "8"])), "label_token_ids"),
    "conflicting_labels": (_score(score_body(labels=["yes"])), "labels"),
    "invalid_labels_type": (_score(score_body(label_token_ids=..., labels="yes")), "labels"),
    "empty_labels": (_score(score_body(label_token_ids=..., labels=[])), "labels"),
    "labels_need_text": (_score(score_body(query=[1, 2], items=[[3]], label_token_ids=..., labels=["a"])), "labels"),
    "empty_label": (_score(score_body(label_token_ids=[5, []])), "label_token_ids"),
    "label_too_long": (_score(score_body(label_token_ids=..., labels=["x" * 9]), max_label_tokens=8), "labels"),
    "invalid_label_normalization": (_score(score_body(label_normalization="max")), "label_normalization"),
    "invalid_label_normalization_type": (_score(score_body(label_normalization=1)), "label_normalization"),
    "invalid_return_token_logprobs_type": (_score(score_body(return_token_logprobs="yes")), "return_token_logprobs"),
    "invalid_apply_softmax_type": (_score(score_body(apply_softmax="true")), "apply_softmax"),
    "invalid_item_first_type": (_score(score_body(item_first=1)), "item_first"),
    "model_not_found": (_score(score_body(model="gpt-4")), "model"),
    "invalid_model_type": (_score(score_body(model=["fake-model"])), "model"),
    "too_many_items": (_score(score_body(items=["x"] * 9)), "items"),
    "too_many_labels": (_score(score_body(label_token_ids=list(range(17)))), "label_token_ids"),
    "empty_sequence": (_score(score_body(), setup=_empty_tokenizer), "items"),
    "context_length_exceeded": (_score(score_body(query="q" * 70)), "items"),
    "too_many_tokens": (_score(score_body(items=["x" * 40] * 8)), "items"),
    "invalid_cache_salt_type": (_rerank({"query": "q", "documents": ["d"], "cache_salt": 7}), "cache_salt"),
    "invalid_cache_salt": (_classify({"input": "x", "cache_salt": ""}), "cache_salt"),
    "missing_text": (_request("POST", "/v1/tokenize", {"add_special_tokens": True}), "text"),
    "invalid_text_type": (_request("POST", "/v1/tokenize", {"text": ["a"]}), "text"),
    "invalid_add_special_tokens_type": (_request("POST", "/v1/tokenize", {"text": "a", "add_special_tokens": "no"}),
                                        "add_special_tokens"),
    "missing_input": (_classify({"model": "sentiment"}), "input"),
    "empty_input": (_classify({"input": [" "]}), "input"),
    "invalid_input_type": (_classify({"input": [1, "a"]}), "input"),
    "invalid_truncate_prompt_tokens_type": (_classify({"input": "a", "truncate_prompt_tokens": "4"}),
                                            "truncate_prompt_tokens"),
    "invalid_truncate_prompt_tokens": (_classify({"input": "a", "truncate_prompt_tokens": 0}),
                                       "truncate_prompt_tokens"),
    "invalid_use_activation_type": (_classify({"input": "a", "use_activation": 1}), "use_activation"),
    "invalid_user_type": (_classify({"input": "a", "user": 1}), "user"),
    "invalid_rid_type": (_classify({"input": "a", "rid": 1}), "rid"),
    "invalid_priority_type": (_classify({"input": "a", "priority": "1"}), "priority"),
    "model_not_supported": (_classify(score_body(), "sequence_classification", "/v1/score"), None),
    "missing_documents": (_rerank({"query": "q"}, "/v2/rerank"), "documents"),
    "empty_documents": (_rerank({"query": "q", "documents": []}), "documents"),
    "invalid_documents_type": (_rerank({"query": "q", "documents": [{"title": "d"}]}, "/rerank"), "documents"),
    "invalid_top_n_type": (_rerank({"query": "q", "documents": ["d"], "top_n": "1"}), "top_n"),
    "invalid_top_n": (_rerank({"query": "q", "documents": ["d"], "top_n": 0}), "top_n"),
    "invalid_return_documents_type": (_rerank({"query": "q", "documents": ["d"], "return_documents": 0}),
                                      "return_documents"),
    "invalid_max_tokens_per_doc_type": (_rerank({"query": "q", "documents": ["d"], "max_tokens_per_doc": 1.5}),
                                        "max_tokens_per_doc"),
    "invalid_max_tokens_per_doc": (_rerank({"query": "q", "documents": ["d"], "max_tokens_per_doc": -3}),
                                   "max_tokens_per_doc"),
    "missing_prompt": (_complete({"max_tokens": 1}), "prompt"),
    "empty_prompt": (_complete(_prompt(prompt=["a", ""])), "prompt"),
    "invalid_prompt_type": (_complete(_prompt(prompt={"text": "a"})), "prompt"),
    "generation_not_supported": (_complete(_prompt(max_tokens=16)), "max_tokens"),
    "invalid_max_tokens_type": (_complete(_prompt(max_tokens="1")), "max_tokens"),
    "invalid_max_tokens": (_complete(_prompt(max_tokens=-1)), "max_tokens"),
    "invalid_echo_type": (_complete(_prompt(echo="yes")), "echo"),
    "invalid_logprobs_type": (_complete(_prompt(logprobs=True)), "logprobs"),
    "invalid_logprobs": (_complete(_prompt(logprobs=21)), "logprobs"),
    "invalid_temperature_type": (_complete(_prompt(temperature="0")), "temperature"),
    "invalid_temperature": (_complete(_prompt(temperature=2.5)), "temperature"),
    "invalid_top_p_type": (_complete(_prompt(top_p="1")), "top_p"),
    "invalid_top_p": (_complete(_prompt(top_p=0.9)), "top_p"),
    "invalid_seed_type": (_complete(_prompt(seed=1.5)), "seed"),
    "invalid_stop_type": (_complete(_prompt(stop=[1])), "stop"),
    "invalid_stop": (_complete(_prompt(stop=["a", "b", "c", "d", "e"])), "stop"),
    "invalid_n_type": (_complete(_prompt(n="1")), "n"),
    "invalid_n": (_complete(_prompt(n=2)), "n"),
    "invalid_best_of_type": (_complete(_prompt(best_of=True)), "best_of"),
    "invalid_best_of": (_complete(_prompt(best_of=3)), "best_of"),
    "invalid_stream_type": (_complete(_prompt(stream="no")), "stream"),
    "stream_not_supported": (_complete(_prompt(stream=True)), "stream"),
    "invalid_suffix_type": (_complete(_prompt(suffix=5)), "suffix"),
    "suffix_not_supported": (_complete(_prompt(suffix=" the end.")), "suffix"),
    "invalid_presence_penalty_type": (_complete(_prompt(presence_penalty="0")), "presence_penalty"),
    "invalid_presence_penalty": (_complete(_prompt(presence_penalty=3)), "presence_penalty"),
    "invalid_frequency_penalty_type": (_complete(_prompt(frequency_penalty=[0])), "frequency_penalty"),
    "invalid_frequency_penalty": (_complete(_prompt(frequency_penalty=-2.5)), "frequency_penalty"),
    "invalid_json": (_score(content=b'{"query": '), None),
    "invalid_body_type": (_score(content=b'["query"]'), None),
    "invalid_api_key": (_score(score_body(), api_keys=("secret",)), None),
    "not_found": (_request("GET", "/v1/nothing"), None),
    "method_not_allowed": (_request("GET", "/v1/score"), None),
    "request_too_large": (_score(content=b" " * (64 * 1024 + 1)), None),
    "rate_limit_exceeded": (_score(score_body(), setup=_set("raise_on_submit", QueueFull())), None),
    "internal_error": (_score(score_body(), setup=_set("fail_with", EngineFault("nan in batch 7"))), None),
    "server_not_ready": (_score(score_body(), setup=_gate, wait_ready=False), None),
    "request_timeout": (_score(score_body(), setup=_set("fail_with", DeadlineExceeded())), None),
}


def test_every_code_has_a_case_or_is_reserved() -> None:
    # invalid_request (malformed HTTP the framework rejects) is produced in test_transport.
    assert set(ERRORS) == set(CASES) | RESERVED | {"invalid_request"}


def test_table_statuses() -> None:
    assert {code for code, spec in ERRORS.items() if spec.status == 422} == {"token_id_exceeds_vocab"}
    assert ERRORS["request_too_large"].status == 413
    assert ERRORS["rate_limit_exceeded"].status == 429
    assert ERRORS["invalid_api_key"].status == 401
    assert ERRORS["internal_error"].status == 500
    assert ERRORS["server_not_ready"].status == ERRORS["request_timeout"].status == 503
    for code, spec in ERRORS.items():
        if code not in RESERVED and spec.status < 500 and spec.status not in (401, 404, 405, 413, 422, 429):
            assert spec.status == 400, code


def test_unknown_code_is_a_programming_error() -> None:
    with pytest.raises(AttributeError):
        ERRORS.no_such_code  # noqa: B018  (raise sites name entries: an unknown one fails where it is named)


def test_every_entry_is_raised_somewhere_or_reserved() -> None:
    """Each entry of ERRORS (other wordings included) is named by a raise site in handler/ or by ENGINE_ERRORS."""
    handler = Path(__file__).resolve().parents[2] / "handler"
    source = "".join(path.read_text() for path in handler.rglob("*.py") if path.name != "errors.py")
    named = {entry.name for entry in ENGINE_ERRORS.values()} | set(re.findall(r"ERRORS\.(\w+)", source))
    entries = {name for name, entry in vars(type(ERRORS)).items() if isinstance(entry, ErrorSpec)}
    assert entries - named == RESERVED


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("code", sorted(CASES))
def test_code(code: str, face: str) -> None:
    produce, param = CASES[code]
    spec = ERRORS[code]
    reply = produce(face, FakeEngine())
    assert reply.status == spec.status, reply.body
    assert reply.json() == {"error": {"message": reply.json()["error"]["message"], "type": spec.type,
                                      "param": param, "code": code}}
    if spec.retry_after_s is not None:
        assert reply.headers["retry-after"] == str(spec.retry_after_s)
    else:
        assert "retry-after" not in reply.headers


@pytest.mark.parametrize("face", FACES)
def test_internal_error_says_nothing_of_the_cause(face: str, caplog: pytest.LogCaptureFixture) -> None:
    reply = CASES["internal_error"][0](face, FakeEngine())
    assert reply.json()["error"]["message"] == INTERNAL_ERROR_MESSAGE
    assert b"nan in batch" not in reply.body and b"Traceback" not in reply.body
    request_id = reply.headers["x-request-id"]
    logged = [r for r in caplog.records if r.name == "scorefn.handler" and request_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the details live in the log, with the request id


@pytest.mark.parametrize("face", FACES)
def test_unexpected_exception_anywhere_is_a_generic_500(face: str) -> None:
    def broken_tokenizer(engine: FakeEngine) -> None:
        def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
            raise RuntimeError("tokenizer exploded at /secret/path")
        engine.tokenize = tokenize  # type: ignore[method-assign]

    reply = _score(score_body(), setup=broken_tokenizer)(face, FakeEngine())
    assert reply.status == 500
    assert reply.json()["error"] == {"message": INTERNAL_ERROR_MESSAGE, "type": "server_error", "param": None,
                                     "code": "internal_error"}


@pytest.mark.parametrize("face", FACES)
def test_submit_raising_anything_else_is_a_generic_500(face: str) -> None:
    reply = _score(score_body(), setup=_set("raise_on_submit", RuntimeError("device lost")))(face, FakeEngine())
    assert reply.status == 500 and reply.json()["error"]["message"] == INTERNAL_ERROR_MESSAGE


@pytest.mark.parametrize("face", FACES)
def test_queue_full_reported_through_the_future_is_429_too(face: str) -> None:
    reply = _score(score_body(), setup=_set("fail_with", QueueFull()))(face, FakeEngine())
    assert reply.status == 429 and reply.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("face", FACES)
def test_a_refusal_says_why_and_when_to_retry(face: str) -> None:
    refusal = QueueFull("this request would wait 5.3 s for the device", retry_after_s=4.2)
    reply = _score(score_body(), setup=_set("raise_on_submit", refusal))(face, FakeEngine())
    assert reply.status == 429 and reply.headers["retry-after"] == "5"  # one header: the engine's, not the default
    message = reply.json()["error"]["message"]
    assert "would wait 5.3 s" in message and message.endswith("Please retry after 5 seconds.")


@pytest.mark.parametrize("face", FACES)
def test_work_cut_short_by_a_shutdown_is_503_server_not_ready(face: str) -> None:
    reply = _score(score_body(), setup=_set("fail_with", ShuttingDown("stopped")))(face, FakeEngine())
    assert reply.status == 503 and reply.json()["error"]["code"] == "server_not_ready"
    assert reply.headers["retry-after"] == str(ERRORS["server_not_ready"].retry_after_s)
