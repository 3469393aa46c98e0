"""W1 and W2, the benchmark's scoring of labels after query + item: W1 a request's latency and throughput at 1, 32
and 256 items (a 15-token query, items of ~8 tokens, 3 labels; 1 item is the single-item latency), W2 one long
query x many 20-token items, 1 label (1000x100, and 2000x500 on accelerators or with --peer), each with its MFU,
against transformers scoring full sequences and (W2) with the query's KV cache computed once and reused."""

from __future__ import annotations

import functools

from runtime.tools.bench.measure import alternating_runs, invariance_cost, request_flops, summarize, timed_runs
from runtime.tools.workloads import FIRST_ID, W1_SIZES, W2_SIZES, w1_request, w2_request


W1_MIN_SECONDS = 3.0  # each of W1's timings runs at least this long (a request can take 50 ms)


def _scorefn_row(scorer, invariant_and_not, cfg, peak: float, sequences, labels, times: list[float]) -> dict:
    """scorefn's row from its `times` on the request: throughput, latency, MFU and the invariance cost."""
    row = summarize(times, len(sequences))
    row["gflops"] = request_flops(cfg, sequences) * row["items_per_s"] / len(sequences) / 1e9
    row["mfu"] = row["gflops"] / peak
    row["invariance_cost"] = invariance_cost(invariant_and_not, lambda s: s.score(sequences, labels), len(times))
    return row


def run_w1(scorer, baselines: dict, cfg, peak: float, smoke: bool, repeats: int, invariant_and_not) -> dict:
    """W1 by request size (items), a line printed as each size is done."""
    result = {}
    min_seconds = 0.0 if smoke else W1_MIN_SECONDS
    for n in (W1_SIZES[:2] if smoke else W1_SIZES):
        sequences, labels = w1_request(cfg.vocab_size, n)
        times = timed_runs(lambda: scorer.score(sequences, labels), repeats, min_seconds=min_seconds)
        entry = {"scorefn": _scorefn_row(scorer, invariant_and_not, cfg, peak, sequences, labels, times)}
        line = f"W1 {n:>3} items: scorefn {entry['scorefn']['items_per_s']:9.1f} items/s " \
               f"p50 {entry['scorefn']['p50_ms']:7.2f} ms (invariance {entry['scorefn']['invariance_cost']:.2f}x)"
        for dt, torch_scorer in baselines.items():
            entry[f"torch_{dt}"] = summarize(timed_runs(lambda: torch_scorer.score_full(sequences, labels),
                                                        max(2, repeats // 4), min_seconds=min_seconds), n)
            line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:8.1f} items/s"
        result[n] = entry
        print(line, flush=True)
    return result


def run_w2(scorer, baselines: dict, cfg, peak: float, smoke: bool, quick: bool, accelerator: bool, peer: bool,
           invariant_and_not) -> dict:
    """W2 by name ("w2", and "w2_peer" at the peers' scale), a line printed as each is done."""
    result = {}
    for name in ["w2"] + (["w2_peer"] if (accelerator or peer) and not smoke else []):
        query_tokens, n_items, item_tokens = (200, 10, 20) if smoke else W2_SIZES[name]
        query, items = w2_request(cfg.vocab_size, query_tokens, n_items, item_tokens)
        sequences, labels = [query + item for item in items], [FIRST_ID]
        # scorefn and the best baseline (the prefix KV cache) in turns; on a CPU the full-sequence baseline once, on
        # a subset: its cost is linear in items (no sharing).
        cached = {f"torch_{dt}_prefix_cache": functools.partial(torch_scorer.score_prefix_cached, query, items, labels)
                  for dt, torch_scorer in baselines.items()}
        times = alternating_runs({"scorefn": lambda: scorer.score(sequences, labels), **cached},
                                 {"scorefn": 2 if quick else 5, **dict.fromkeys(cached, 2 if not accelerator else 3)})
        entry = {"query_tokens": query_tokens, "items": n_items,
                 "scorefn": _scorefn_row(scorer, invariant_and_not, cfg, peak, sequences, labels, times["scorefn"])}
        line = f"W2 {query_tokens}x{n_items}x{item_tokens}: scorefn {entry['scorefn']['items_per_s']:.1f} items/s " \
               f"(MFU {entry['scorefn']['mfu']:.3f}, invariance {entry['scorefn']['invariance_cost']:.2f}x)"
        subset = n_items if accelerator else 2 if smoke else 8 if quick else 20
        for dt, torch_scorer in baselines.items():
            entry[f"torch_{dt}"] = summarize(timed_runs(
                lambda: torch_scorer.score_full(sequences[:subset], labels), 1 if not accelerator else 3,
                warmup=0 if not accelerator else 1), subset)
            entry[f"torch_{dt}_prefix_cache"] = summarize(times[f"torch_{dt}_prefix_cache"], n_items)
            line += f" | torch {dt} {entry[f'torch_{dt}']['items_per_s']:.2f}, prefix cache " \
                    f"{entry[f'torch_{dt}_prefix_cache']['items_per_s']:.1f} items/s"
        result[name] = entry
        print(line, flush=True)
    return result
