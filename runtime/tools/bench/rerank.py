"""W5, the benchmark's reranking: a 64-token query and 100 documents of 100 tokens in the reranker's template,
yes/no labels, scored with prefix sharing on and off, against transformers scoring full sequences and with the
shared prefix's KV cache reused."""

from __future__ import annotations

import functools

from runtime.assembly import startup
from runtime.tools.bench.measure import alternating_runs, invariance_cost, summarize, timed_runs, torch_pairs
from runtime.tools.workloads import W5_SIZE, w5_request


def run_w5(scorer, settings, loaded, baselines: dict, vocab: int, smoke: bool, quick: bool, invariant_and_not) -> dict:
    """Reranking: pairs that share the template head and the query, scored with and without prefix sharing.
    Prints its line."""
    sizes = (27, 16, 4, 16, 8) if smoke else W5_SIZE
    documents = sizes[2]
    prefix, rests, labels = w5_request(vocab, *sizes)
    sequences = [prefix + rest for rest in rests]
    unshared, _ = startup.scorer(settings.replace(prefix_sharing=False), loaded, lazy=True)
    runs = 2 if quick else 5
    # scorefn and the best baseline (the prefix KV cache) in turns
    cached = {f"torch_{dt}_prefix_cache": functools.partial(torch_scorer.score_prefix_cached, prefix, rests, labels)
              for dt, torch_scorer in baselines.items()}
    times = alternating_runs({"scorefn": lambda: scorer.score(sequences, labels), **cached},
                             {"scorefn": runs, **dict.fromkeys(cached, 2)})
    entry = {"documents": documents, **{name: summarize(t, documents) for name, t in times.items()},
             "scorefn_no_sharing": summarize(timed_runs(lambda: unshared.score(sequences, labels), runs), documents)}
    entry["scorefn"]["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.score(sequences, labels), runs)
    for dt, torch_scorer in baselines.items():
        entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_full(sequences, labels),
                                                    max(1, runs // 2)), documents)
    line = f"W5 rerank {entry['documents']} documents: scorefn {entry['scorefn']['items_per_s']:.1f} documents/s, " \
           f"prefix sharing off {entry['scorefn_no_sharing']['items_per_s']:.1f}, invariance " \
           f"{entry['scorefn']['invariance_cost']:.2f}x"
    print(line + torch_pairs(entry, baselines, "prefix_cache", "prefix cache", "documents/s"), flush=True)
    return entry
