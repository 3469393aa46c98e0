"""W4, the benchmark's per-position log-probabilities: 64 prompts of 256 tokens, every position's log-probability
and top 5 (as /v1/completions echoes them), against transformers computing the same."""

from __future__ import annotations

import functools

from runtime.tools.bench.measure import alternating_runs, invariance_cost, summarize
from runtime.tools.workloads import W4_SIZE, w4_prompts


def run_w4(scorer, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Per-token log-probabilities with the top alternatives of every position (an evaluation harness's load).
    Prints its line."""
    prompts, tokens, top_k = (4, 32, W4_SIZE[2]) if smoke else W4_SIZE
    sequences = w4_prompts(vocab, prompts, tokens)
    runs = 2 if quick else 5
    fns = {"scorefn": lambda: scorer.token_logprobs(sequences)}
    fns.update({f"torch_{dt}": functools.partial(torch_scorer.token_logprobs, sequences, top_k)
                for dt, torch_scorer in baselines.items()})
    times = alternating_runs(fns, {name: runs if name == "scorefn" else 2 for name in fns})
    entry = {"prompts": prompts, "tokens": tokens, **{name: summarize(t, prompts) for name, t in times.items()}}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.token_logprobs(sequences),
                                                          runs)
    for row in entry.values():
        if isinstance(row, dict):
            row["tokens_per_s"] = row["items_per_s"] * tokens
    line = f"W4 {entry['prompts']}x{entry['tokens']} echo+logprobs {W4_SIZE[2]}: scorefn " \
           f"{entry['scorefn']['items_per_s']:.1f} prompts/s ({entry['scorefn']['tokens_per_s']:.0f} tokens/s, " \
           f"invariance {entry['scorefn']['invariance_cost']:.2f}x)"
    for dt in baselines:
        line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:.2f} prompts/s"
    print(line, flush=True)
    return entry
