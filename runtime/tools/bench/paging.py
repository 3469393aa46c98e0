"""W9, a recommender paging members' profiles after one instruction: each request is an instruction (cached since the
first member's request), then one member's profile, then a page of items; each member's first page, then its second.
With the prefix cache, a member's first page computes its query past the cached instruction once (extend_context) and
keeps it, and the second page reads all of it. Against the same cache without extensions (the first page computes
the whole query again, or its items each compute the profile) and against no cache; the same bits each way."""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from runtime.requests.jobs import Job
from runtime.requests.prefix_cache import MIN_TOKENS, PrefixCache
from runtime.requests.scorer import Scorer
from runtime.tools.workloads import FIRST_ID, W9_SIZE, token_ids


def run_w9(scorer: Scorer, vocab: int, smoke: bool, quick: bool) -> dict:
    """Prints its line; `scorer` runs without a prefix cache (the bench's settings), copies of it with one."""
    instruction_tokens, profile_tokens, items, members = W9_SIZE
    if smoke:
        instruction_tokens, profile_tokens, items, members = 300, 20, 4, 2
    elif quick:
        members = 3
    rng = np.random.default_rng(9)
    instruction = token_ids(rng, vocab, instruction_tokens)
    profiles = [token_ids(rng, vocab, profile_tokens) for _ in range(members + 1)]
    pages = [[Job([instruction + profile + token_ids(rng, vocab, 10) for _ in range(items)], [FIRST_ID, FIRST_ID + 1])
              for _ in range(2)] for profile in profiles]
    sides = {"extended": Scorer(dataclasses.replace(scorer.plan, kept_prompts=MIN_TOKENS), scorer.exe,
                                scorer.launcher.threads, PrefixCache(1 << 30)),
             "not_extended": Scorer(dataclasses.replace(scorer.plan, kept_prompts=0), scorer.exe,
                                    scorer.launcher.threads, PrefixCache(1 << 30)),
             "no_cache": scorer}
    latencies: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in sides}
    scores: dict[str, list] = {}

    def run(name: str, timed: bool) -> None:
        s = sides[name]
        if s.prefix_cache is not None:  # a fresh cache that holds the instruction (the first member's request)
            s.prefix_cache.clear()
        s.score_jobs([pages[0][0]])
        scores[name] = []
        for first, second in pages[1:]:
            for job, kept in ((first, latencies[name][0]), (second, latencies[name][1])):
                started = time.perf_counter()
                scores[name].append(s.score_jobs([job])[0])
                if timed:
                    kept.append(time.perf_counter() - started)
    for name in sides:  # the buckets each side reads compile before the timing (a server compiles them at start)
        run(name, timed=False)
    for _ in range(1 if smoke or quick else 3):
        for name in sides:
            run(name, timed=True)
    entry: dict = {name: {"first_page_ms": statistics.median(first) * 1e3,
                          "second_page_ms": statistics.median(second) * 1e3}
                   for name, (first, second) in latencies.items()}
    entry["same_bits"] = all(np.array_equal(a, b) for name in ("extended", "not_extended")
                             for a, b in zip(scores[name], scores["no_cache"], strict=True))
    first = {name: entry[name]["first_page_ms"] for name in sides}
    entry["extended_vs_not"] = first["not_extended"] / first["extended"]
    entry["extended_vs_none"] = first["no_cache"] / first["extended"]
    print(f"W9 paged profiles ({instruction_tokens}-token instruction cached, {profile_tokens}-token profiles, "
          f"{items} items a page): a member's first page {first['extended']:.0f} ms with extensions, "
          f"{entry['extended_vs_not']:.2f}x faster than the cache without them, {entry['extended_vs_none']:.2f}x than "
          f"none; second page {entry['extended']['second_page_ms']:.0f} ms; the same bits: "
          f"{'yes' if entry['same_bits'] else 'NO'}", flush=True)
    return entry
