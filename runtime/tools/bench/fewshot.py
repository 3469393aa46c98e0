"""The prefix cache's workloads. W7, a few-shot classifier: a fixed prompt of 1,500 tokens, one input of 30 tokens and
a cue per request, two labels; requests one at a time, and eight at once (one round). scorefn with its prefix cache
against scorefn without (the same compiled programs), and against the transformers script an expert would write: the
prompt's past_key_values computed once, each input scored after a copy of them. W8, lm-evaluation-harness's multiple
choice (one prompt per answer, read at every position, one request at a time): with the cache against without, and
whether every output has the same bits."""

from __future__ import annotations

import dataclasses

import numpy as np

from runtime.interface import Sampling
from runtime.requests.jobs import Job, TokenJob
from runtime.requests.prefix_cache import MIN_TOKENS, PrefixCache
from runtime.requests.scorer import Scorer
from runtime.tools.bench.measure import alternating_runs, summarize
from runtime.tools.workloads import FIRST_ID, W7_SIZE, W8_SIZE, w7_requests, w8_prompts

CLIENTS = 8  # requests at once


def run_w7(scorer: Scorer, baselines: dict, vocab: int, smoke: bool, quick: bool) -> dict:
    """Prints its line; `scorer` runs without a prefix cache (the bench's settings), a copy of it with one."""
    prompt_tokens, input_tokens, cue_tokens, requests = W7_SIZE
    if smoke:
        prompt_tokens, input_tokens, requests = 300, 10, CLIENTS
    elif quick:
        requests = 2 * CLIENTS
    sequences = w7_requests(vocab, prompt_tokens, input_tokens, cue_tokens, requests)
    labels = [FIRST_ID, FIRST_ID + 1]
    shared = len(sequences[0]) - input_tokens - cue_tokens
    cached = Scorer(scorer.plan, scorer.exe, scorer.launcher.threads, PrefixCache(1 << 30))
    cached.score([sequences[0]], labels)  # the prompt enters the cache (each side's buckets compile)
    scorer.score([sequences[0]], labels)
    # The buckets a hit reads, alone and eight at once, compiled before the timing (a server compiles them at start)
    cached.score([sequences[1]], labels)
    cached.score_jobs([Job([sequence], labels) for sequence in sequences[:CLIENTS]])
    held = []

    def one_at_a_time(s: Scorer) -> None:
        for sequence in sequences:
            dispatched = s.dispatch([Job([sequence], labels)])
            s.collect(dispatched)
            if s is cached:
                held.append(dispatched.cached_tokens[0])

    def together(s: Scorer) -> None:
        for start in range(0, len(sequences), CLIENTS):
            s.score_jobs([Job([sequence], labels) for sequence in sequences[start:start + CLIENTS]])

    fns = {"cache": lambda: one_at_a_time(cached), "no_cache": lambda: one_at_a_time(scorer),
           "cache_8": lambda: together(cached), "no_cache_8": lambda: together(scorer)}
    runs = 1 if smoke or quick else 3
    times = alternating_runs(fns, dict.fromkeys(fns, runs), warmup=0)
    entry = {name: summarize([t / len(sequences) for t in times[name]], 1) for name in fns}
    entry["cached_share"] = min(held) / shared if held else 0.0  # of the shared prompt, on every request
    for dt, torch_scorer in baselines.items():
        prefix = torch_scorer.prefix(sequences[0][:shared])
        entry[f"torch_{dt}_prompt_cache"] = summarize(alternating_runs(
            {"torch": lambda: [torch_scorer.score_after_prefix(prefix, [s[shared:]], labels) for s in sequences]},
            {"torch": runs}, warmup=0)["torch"], len(sequences))
    rate = {name: entry[name]["items_per_s"] for name in fns}
    line = (f"W7 few-shot classifier ({prompt_tokens}-token prompt, {requests} requests): scorefn with the prefix "
            f"cache {rate['cache']:.1f} requests/s one at a time ({rate['cache'] / rate['no_cache']:.1f}x without), "
            f"{rate['cache_8']:.1f} eight at once ({rate['cache_8'] / rate['no_cache_8']:.1f}x); cached "
            f"{entry['cached_share']:.1%} of the prompt")
    line += "".join(f" | torch {dt} past_key_values {entry[f'torch_{dt}_prompt_cache']['items_per_s']:.1f} "
                    f"requests/s" for dt in baselines)
    print(line, flush=True)
    entry["scorefn"] = entry["cache"]
    return entry


def run_w8(scorer: Scorer, vocab: int, smoke: bool, quick: bool) -> dict:
    """Prints its line. Both sides on the plan with the cache's programs (`scorer`'s, compiled as used), one with a
    cache cleared before each run (an lm-eval run starts on a fresh server), one without."""
    question_tokens, answers, questions = W8_SIZE
    if smoke:
        question_tokens, questions = 300, 2
    elif quick:
        questions = 6
    prompts = w8_prompts(vocab, question_tokens, answers, questions)
    plan = dataclasses.replace(scorer.plan, kept_prompts=MIN_TOKENS)
    cached = Scorer(plan, scorer.exe, scorer.launcher.threads, PrefixCache(1 << 30))
    plain = Scorer(plan, scorer.exe, scorer.launcher.threads)
    outputs: dict[str, list] = {}
    held: list[int] = []  # the tokens each prompt of the last run with the cache read from it

    def run(s: Scorer, name: str) -> None:
        if s.prefix_cache is not None:
            s.prefix_cache.clear()
            held.clear()
        outputs[name] = []
        for prompt in prompts:
            dispatched = s.dispatch([TokenJob([prompt], [Sampling()])])
            outputs[name] += s.collect(dispatched)[0]
            if s.prefix_cache is not None:
                held.append(dispatched.cached_tokens[0])
    fns = {"cache": lambda: run(cached, "cache"), "no_cache": lambda: run(plain, "no_cache")}
    for name in fns:  # the buckets each side reads compile before the timing (a server compiles them at start)
        run(cached if name == "cache" else plain, name)
    times = alternating_runs(fns, dict.fromkeys(fns, 1 if smoke or quick else 3), warmup=0)
    entry = {name: summarize([t / len(prompts) for t in times[name]], 1) for name in fns}
    same = all(np.array_equal(getattr(a, field), getattr(b, field)) and (a.next_id, a.next_logprob) ==
               (b.next_id, b.next_logprob) for a, b in zip(outputs["cache"], outputs["no_cache"])
               for field in ("next_logprobs", "top_ids", "top_logprobs"))
    entry.update(same_bits=same, cache_vs_none=entry["cache"]["items_per_s"] / entry["no_cache"]["items_per_s"],
                 cached_tokens=float(np.mean(held)))
    print(f"W8 multiple choice through per-position log-probabilities ({questions} questions of {question_tokens} "
          f"tokens, {answers} answers): with the prefix cache {entry['cache']['items_per_s']:.1f} prompts/s, "
          f"{entry['cache_vs_none']:.2f}x without; {entry['cached_tokens']:.0f} tokens a prompt from the cache (mean); "
          f"the same bits: "
          f"{'yes' if same else 'NO'}", flush=True)
    entry["scorefn"] = entry["cache"]
    return entry
