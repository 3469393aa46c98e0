"""`python -m loadtests.examples --url URL`: every request the README and docs/ show, sent to a server as a new user
sends them, each `--repeat` times in a row on an otherwise idle server; then (`--bursts`) 16 threads sending 48
requests at once, of one item and of two items after a 750-token query. Every answer must be a 200: an idle instance
refuses nothing within the limits (docs/how-it-works/admission.md). Prints each request's statuses and latencies, and
the bursts' p50/p99; exits 1 if anything was not a 200.

The documented requests are the `curl ... localhost:8080/<path> ... -d '<JSON>'` lines of README.md and docs/ (those
naming a LoRA adapter the server does not serve are listed as skipped). Standard library only, like the serve-only
check: `python -m loadtests.examples --url http://127.0.0.1:8080 --repeat 20 --bursts`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CURL = re.compile(r"curl -s localhost:8080(/[\w/]+) -H 'content-type: application/json' -d '(.*?)'", re.S)
PARIS = 7042
BURST_THREADS, BURST_REQUESTS = 16, 48


def documented_requests(repo: Path = REPO) -> list[tuple[str, str, dict]]:
    """(where, path, body) of every POST the README and docs/ show with curl."""
    found = []
    for page in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]:
        for path, body in CURL.findall(page.read_text()):
            found.append((str(page.relative_to(repo)), path, json.loads(body)))
    return found


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, float]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status, time.perf_counter() - started
    except urllib.error.HTTPError as error:
        error.read()
        return error.code, time.perf_counter() - started


def long_query(url: str, tokens: int) -> str:
    """A query of at least `tokens` tokens, as the issue that asked for these cases wrote it."""
    words = " and so on" * (tokens // 3)
    while True:
        text = "The capital of France is" + words
        request = urllib.request.Request(url + "/v1/tokenize", json.dumps({"text": text}).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request) as response:
            count = json.loads(response.read())["count"]
        if count >= tokens:
            return text
        words += " and so on" * max(1, (tokens - count) // 3)


def cases(url: str) -> list[tuple[str, str, dict]]:
    """The documented requests and two long queries' two items (the requests an idle server once refused)."""
    extra = [(f"two items after a {n}-token query", "/v1/score",
              {"query": long_query(url, n), "items": [" Paris", " London"], "label_token_ids": [PARIS]})
             for n in (360, 750)]
    return documented_requests() + extra


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * q // 100) - 1)] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.examples", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--repeat", type=int, default=20, help="each request this many times in a row")
    parser.add_argument("--bursts", action="store_true", help="then the two 16-thread bursts of 48 requests")
    args = parser.parse_args(argv)
    with urllib.request.urlopen(args.url + "/v1/models") as response:
        served = {model["id"] for model in json.loads(response.read())["data"]}
    failures = 0
    for where, path, body in cases(args.url):
        if "model" in body and body["model"] not in served:
            print(f"skipped  {path:16} {where}: model {body['model']!r} is not served here")
            continue
        answers = [post(args.url + path, body) for _ in range(args.repeat)]
        statuses = [status for status, _ in answers]
        failures += sum(status != 200 for status in statuses)
        seconds = [s for _, s in answers]
        print(f"{statuses.count(200):3d}/{len(statuses)} 200  {path:16} p50 {percentile(seconds, 50):6.2f} s  "
              f"max {max(seconds):6.2f} s  {where}" + ("" if set(statuses) == {200} else f"  statuses {statuses}"),
              flush=True)
    if args.bursts:
        one = {"query": "The capital of France is", "items": [""], "label_token_ids": [PARIS, 4528]}
        two = {"query": long_query(args.url, 750), "items": [" Paris", " London"], "label_token_ids": [PARIS]}
        for name, body in (("one item", one), ("two items after a 750-token query", two)):
            with concurrent.futures.ThreadPoolExecutor(BURST_THREADS) as pool:
                answers = list(pool.map(lambda _: post(args.url + "/v1/score", body), range(BURST_REQUESTS)))
            statuses = [status for status, _ in answers]
            answered = [s for status, s in answers if status == 200]
            failures += sum(status != 200 for status in statuses)
            print(f"burst of {BURST_REQUESTS} from {BURST_THREADS} threads, {name}: {statuses.count(200)} answered, "
                  f"{statuses.count(429)} refused; answered p50 {percentile(answered, 50):.2f} s, p99 "
                  f"{percentile(answered, 99):.2f} s", flush=True)
    print("PASSED" if not failures else f"FAILED: {failures} answers were not 200")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
