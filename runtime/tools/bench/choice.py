"""W6, the benchmark's multiple choice: a 200-token query, 100 items of 20 tokens, 4 labels of 2-8 tokens, as label
rows; against transformers scoring each (prompt, label) sequence, and with each prompt's KV cache reused for its
labels."""

from __future__ import annotations

from runtime.requests.jobs import label_rows, label_scores
from runtime.tools.bench.measure import invariance_cost, summarize, timed_runs, torch_pairs
from runtime.tools.workloads import W6_SIZE, w6_request


def run_w6(scorer, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Multiple choice at scale: labels of several tokens after each query + item, scored as label rows (the query
    computed once, each item's rows after it) against transformers scoring every (prompt, label) sequence in full,
    and against it with each prompt's KV cache reused for its labels. Prints its line."""
    query_tokens, n_items, item_tokens, label_tokens = (40, 4, 8, (2, 3)) if smoke else W6_SIZE
    query, items, labels = w6_request(vocab, query_tokens, n_items, item_tokens, label_tokens)
    prompts = [query + item for item in items]
    runs = 2 if quick else 5

    def ours(s):
        return label_scores(s.score_jobs([label_rows(prompts, labels)])[0], labels)[0]
    entry = {"items": n_items, "labels": len(labels),
             "scorefn": summarize(timed_runs(lambda: ours(scorer), runs), n_items)}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, ours, runs)
    subset = n_items if smoke else 10  # the full-sequence baseline is linear in items: timed on a subset
    for dt, torch_scorer in baselines.items():
        entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_labels_full(prompts[:subset], labels),
                                                    1, warmup=0), subset)
        entry[f"torch_{dt}_prompt_cache"] = summarize(timed_runs(
            lambda: torch_scorer.score_labels_prompt_cached(prompts, labels), max(1, runs // 2)), n_items)
    line = f"W6 multiple choice {entry['items']} items x {entry['labels']} labels: scorefn " \
           f"{entry['scorefn']['items_per_s']:.1f} items/s (invariance {entry['scorefn']['invariance_cost']:.2f}x)"
    print(line + torch_pairs(entry, baselines, "prompt_cache", "prompt cache", "items/s"), flush=True)
    return entry
