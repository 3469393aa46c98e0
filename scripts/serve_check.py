"""The serve-only check `make test` runs first: what a new user's `make serve` gets must work on its own.

Run with the Python of a venv made exactly as `make serve` makes one (lock/serve.txt and lock/embedded.txt, then
scorefn editable; no test or load extras). It runs every serve-time command there: `scorefn score`,
`scorefn warmup`, `scorefn serve` (through the same console script as `make serve` and the container's
ENTRYPOINT) with one /v1/score, /v1/classify, /v1/rerank, /v1/completions and /v1/tokenize checked by value,
then SIGTERM and exit 0, and `scorefn coldstart`. Small shape buckets keep it quick; the code path is the real
one. Standard library only. scripts/image_check.py runs the same endpoint checks on the container image.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess, request_json

PARIS, LONDON = 7042, 4528  # SmolLM2's " Paris", " London"
PARIS_LOGPROB = -0.258  # transformers float32 on the embedded model (DESIGN.md)
SCORE_TOLERANCE = {"float32": 2e-3, "bfloat16": 0.15}  # by the served dtype (GET /v1/models); bfloat16: the
# embedded model's worst error in tests/runtime/model/test_parity_embedded.py
TEST_ONLY = ("torch", "pytest", "locust")  # test extras: their presence would hide a missing main dependency
SCOREFN = str(Path(sys.executable).with_name("scorefn"))
ENV = {**os.environ, **SMALL_BUCKETS}


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"serve-only check FAILED: {what}")
    print(f"ok: {what}", flush=True)


def run(*args: str) -> str:
    started = time.perf_counter()
    done = subprocess.run([SCOREFN, *args], env=ENV, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"serve-only check FAILED: `scorefn {' '.join(args)}` exited {done.returncode}")
    print(f"ok: `scorefn {' '.join(args)}` exited 0 in {time.perf_counter() - started:.1f} s", flush=True)
    return done.stdout


def check_cli() -> None:
    scores = json.loads(run("score", "--query", "The capital of France is", "--labels", " Paris", " London"))
    check(scores["label_token_ids"] == [PARIS, LONDON], "scorefn score finds the one-token labels")
    check(abs(scores["scores"][0][0] - PARIS_LOGPROB) < SCORE_TOLERANCE["float32"],
          f"scorefn score: log P(' Paris') = {scores['scores'][0][0]:.4f} (transformers: {PARIS_LOGPROB})")
    timings = json.loads(run("warmup").splitlines()[-1])
    check(timings["buckets"] > 0 and timings["pending"] == 0,
          f"scorefn warmup compiled or loaded all {timings['buckets']} buckets ({timings['pending']} left pending)")
    run("coldstart")


def endpoint_checks(url: str) -> Iterator[tuple[str, bool, str]]:
    """(name, passed, what was seen) for /v1/score, /v1/classify, /v1/rerank, /v1/completions and /v1/tokenize of a
    ready server at `url`, each checked by value. Shared with scripts/image_check.py, which runs them on the image."""
    dtype = request_json(url + "/v1/models")[1]["data"][0]["dtype"]
    tolerance = SCORE_TOLERANCE[dtype]
    status, body = request_json(url + "/v1/score", {
        "query": "The capital of France is", "items": [""], "label_token_ids": [PARIS, LONDON]})
    paris = body["scores"][0][0] if status == 200 else float("nan")
    yield "score", status == 200 and abs(paris - PARIS_LOGPROB) < tolerance, \
        f"POST /v1/score ({dtype}): {status}, log P(' Paris') = {paris:.4f} (transformers float32: {PARIS_LOGPROB})"
    status, body = request_json(url + "/v1/classify", {
        "model": "sentiment", "input": ["I absolutely loved this movie, it was wonderful!"]})
    yield "classify", status == 200 and body["data"][0]["label"] == "positive", \
        f"POST /v1/classify: {status} {body.get('data')}"
    status, body = request_json(url + "/v1/rerank", {
        "model": "relevance", "query": "Capital of France?",
        "documents": ["Bananas are yellow.", "Paris is the capital of France."]})
    yield "rerank", status == 200 and body["results"][0]["index"] == 1, f"POST /v1/rerank: {status} {body.get('results')}"
    status, body = request_json(url + "/v1/completions", {
        "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1})
    choice = body.get("choices", [{}])[0] if status == 200 else {}
    yield "completions", (status == 200 and choice["text"] == "The capital of France is Paris"
                          and abs(choice["logprobs"]["token_logprobs"][-1] - PARIS_LOGPROB) < tolerance), \
        f"POST /v1/completions: {status} {choice.get('text')!r}"
    status, body = request_json(url + "/v1/tokenize", {"text": " Paris"})
    yield "tokenize", status == 200 and body["tokens"] == [PARIS], f"POST /v1/tokenize: {status} {body}"


def check_server() -> None:
    with ServerProcess(env=SMALL_BUCKETS) as server:
        for _, passed, what in endpoint_checks(server.url):
            check(passed, what)
        server.signal(signal.SIGTERM)
        code = server.proc.wait(timeout=60)
        check(code == 0, f"SIGTERM: the server exited {code}")


def main() -> int:
    present = [name for name in TEST_ONLY if importlib.util.find_spec(name) is not None]
    check(not present, f"the serve-only venv {sys.prefix} has no test-only package {present or ''}".rstrip())
    check_cli()
    check_server()
    print("serve-only check passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
