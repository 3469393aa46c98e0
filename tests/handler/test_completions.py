"""POST /v1/completions on both faces with the fake engine: OpenAI's legacy shape, prefill only (see
tests/handler/fake_engine.py for the hand-computable log-probabilities)."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.interface import Sampling
from tests.handler.clients import Client
from tests.handler.conftest import assert_error
from tests.handler.fake_engine import BOS, FakeEngine

LM_EVAL = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # what lm-eval sends


def complete(client: Client, **body: Any) -> dict:
    reply = client.post("/v1/completions", json=body)
    assert reply.status == 200, reply.body
    assert {"x-request-id", "x-queue-time", "x-device-time", "x-total-time"} <= set(reply.headers)
    return reply.json()


def next_logprob(token: int) -> float:
    return -(token % 7) - 0.5


def test_lm_evaluation_harness_request(client: Client, engine: FakeEngine) -> None:
    prompts = [[10, 20, 30], [40, 50]]
    body = complete(client, model="fake-model", prompt=prompts, **LM_EVAL)
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "fake-model"
    assert engine.submissions[-1][0] == prompts
    assert engine.sampling == [Sampling(0.0, 1234)] * 2
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0}}
    first, second = body["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["text"] == "\n\x14\x1ea" and first["finish_reason"] == "length"  # the prompt, then "a" (97)
    logprobs = first["logprobs"]
    assert logprobs["tokens"] == ["\n", "\x14", "\x1e", "a"]
    assert logprobs["token_logprobs"] == pytest.approx([None, next_logprob(20), next_logprob(30), -0.12])
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    # After position t the top token is "a" with -0.1 - 0.01 t, and the actual token is always there too.
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == pytest.approx({"a": -0.1, "\x14": next_logprob(20)})
    assert logprobs["top_logprobs"][3] == pytest.approx({"a": -0.12})
    # lm-evaluation-harness reads the continuation's log-probabilities as token_logprobs[ctxlen:-1].
    ctxlen = 1
    assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(next_logprob(20) + next_logprob(30))


def test_text_prompt_echoed_as_given(client: Client) -> None:
    body = complete(client, prompt="hi", max_tokens=1, temperature=0, echo=True, logprobs=2)
    choice = body["choices"][0]
    assert choice["text"] == "hia"
    assert choice["logprobs"]["tokens"] == [chr(BOS), "h", "i", "a"]  # the tokenizer's BOS, then the text
    assert choice["logprobs"]["top_logprobs"][3] == pytest.approx({"a": -0.12, "b": -0.22})


def test_the_prompt_alone_and_the_completion_alone(client: Client) -> None:
    prompt_only = complete(client, prompt=[[5, 6]], max_tokens=0, echo=True, logprobs=0)["choices"][0]
    assert prompt_only["text"] == "\x05\x06" and prompt_only["finish_reason"] == "length"
    assert prompt_only["logprobs"]["token_logprobs"] == pytest.approx([None, next_logprob(6)])
    assert prompt_only["logprobs"]["top_logprobs"] == [None, {"\x06": pytest.approx(next_logprob(6))}]  # logprobs 0
    completion = complete(client, prompt=[5, 6], max_tokens=1, temperature=0, logprobs=1)["choices"][0]
    assert completion["text"] == "a"
    assert completion["logprobs"] == {"tokens": ["a"], "token_logprobs": [pytest.approx(-0.11)],
                                      "top_logprobs": [{"a": pytest.approx(-0.11)}], "text_offset": [0]}
    nothing = complete(client, prompt=[5, 6], max_tokens=0)
    assert nothing["choices"][0]["text"] == "" and nothing["choices"][0]["logprobs"] is None
    assert nothing["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_sampling_follows_temperature_and_seed(client: Client, engine: FakeEngine) -> None:
    seeded = complete(client, prompt=["ab", "cd"], max_tokens=1, temperature=0.7, seed=3)
    assert engine.sampling == [Sampling(0.7, 3)] * 2 and seeded["choices"][0]["text"] == "d"  # 97 + 3
    complete(client, prompt=["ab", "cd"], max_tokens=1)  # OpenAI's default temperature is 1; no seed: random
    assert [s.temperature for s in engine.sampling] == [1.0, 1.0]
    assert all(0 <= s.seed < 2**32 for s in engine.sampling)


def test_a_stop_string_cuts_the_completion(client: Client) -> None:
    choice = complete(client, prompt="x", max_tokens=1, temperature=0, stop=["a"], echo=True)["choices"][0]
    assert choice["text"] == "x" and choice["finish_reason"] == "stop"  # the prompt as given, nothing after
    unaffected = complete(client, prompt="x", max_tokens=1, temperature=0, stop="zz")["choices"][0]
    assert unaffected["text"] == "a" and unaffected["finish_reason"] == "length"


def test_null_means_absent(client: Client) -> None:
    body = complete(client, prompt=[7], max_tokens=1, echo=None, logprobs=None, temperature=None, seed=None,
                    stop=None, n=None, best_of=None, stream=None, suffix=None, user=None, model=None,
                    presence_penalty=None, frequency_penalty=None, top_p=None)
    assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("fields,code,param", [
    ({"max_tokens": ...}, "generation_not_supported", "max_tokens"),
    ({"max_tokens": None}, "generation_not_supported", "max_tokens"),
    ({"max_tokens": 2}, "generation_not_supported", "max_tokens"),
    ({"prompt": [[1, 2], []]}, "empty_prompt", "prompt"),
    ({"prompt": [3, -1]}, "negative_token_id", "prompt"),
    ({"model": "gpt-3.5-turbo-instruct"}, "model_not_found", "model"),
    ({"prompt": "x" * 70}, "context_length_exceeded", "prompt"),
    ({"prompt": ["x"] * 9}, "too_many_items", "prompt"),
])
def test_errors(client: Client, fields: dict, code: str, param: str) -> None:
    body = {k: v for k, v in {"prompt": "abc", "max_tokens": 1, **fields}.items() if v is not ...}
    assert_error(client.post("/v1/completions", json=body), 400, code, param)


def test_token_ids_beyond_the_vocabulary_are_422(client: Client) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": [[5, 1000]], "max_tokens": 0}), 422,
                 "token_id_exceeds_vocab", "prompt")


def test_a_classification_model_has_no_token_log_probabilities(client: Client, engine: FakeEngine) -> None:
    engine.task = "sequence_classification"
    assert_error(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}), 400, "model_not_supported")
