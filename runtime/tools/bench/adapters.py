"""LoRA in the benchmark: 8 seeded random adapters of rank 16 on every projection, W1-256 as 8 requests of 32 items
(one adapter each, mixed in one device round) and W2 with one adapter, against the base model on the same
requests (runtime.model.lora)."""

from __future__ import annotations

from runtime.assembly.compose import compose
from runtime.model import lora
from runtime.requests.jobs import Job
from runtime.tools.bench.measure import summarize, timed_runs
from runtime.tools.workloads import FIRST_ID, LORA_SIZE, W1_SIZES, W2_SIZES, random_adapters, w1_request, w2_request


def run_lora(settings, loaded, scorer, vocab: int, smoke: bool, quick: bool) -> dict:
    """LoRA adapters mixed in one device round against the base model on the same requests (runtime.model.lora):
    the adapters' cost in the programs (every projection's update for every slot at once). Prints its line."""
    adapters, rank, requests = (2, 4, 2) if smoke else LORA_SIZE
    items = 16 if smoke else W1_SIZES[-1]
    cfg = loaded.cfg
    shapes = lora.projection_shapes(cfg)
    adapted, _ = compose(settings.replace(max_loras=adapters, max_lora_rank=rank), cfg, loaded.arrays, lazy=True,
                         quiet=True, adapters=random_adapters(shapes, cfg.num_layers, adapters, rank))
    sequences, labels = w1_request(vocab, items)
    base_jobs = [Job(sequences[r::requests], labels) for r in range(requests)]
    mixed_jobs = [Job(job.sequences, labels, adapter=r % adapters + 1) for r, job in enumerate(base_jobs)]
    query_tokens, n_items, item_tokens = (200, 10, 20) if smoke else W2_SIZES["w2"]
    query, rest = w2_request(vocab, query_tokens, n_items, item_tokens)
    w2 = [query + item for item in rest]
    runs = 2 if quick else 5
    entry = {"adapters": adapters, "rank": rank, "items": items, "requests": requests,
             "w1_base": summarize(timed_runs(lambda: scorer.score_jobs(base_jobs), runs), items),
             "w1_mixed": summarize(timed_runs(lambda: adapted.score_jobs(mixed_jobs), runs), items),
             "w2_base": summarize(timed_runs(lambda: scorer.score_jobs([Job(w2, [FIRST_ID])]), runs), n_items),
             "w2_adapter": summarize(timed_runs(lambda: adapted.score_jobs([Job(w2, [FIRST_ID], adapter=1)]), runs),
                                     n_items)}
    entry["w1_ratio"] = entry["w1_mixed"]["items_per_s"] / entry["w1_base"]["items_per_s"]
    entry["w2_ratio"] = entry["w2_adapter"]["items_per_s"] / entry["w2_base"]["items_per_s"]
    print(f"LoRA {entry['adapters']} adapters of rank {entry['rank']}: W1 {entry['items']} items as "
          f"{entry['requests']} requests, one adapter each: {entry['w1_mixed']['items_per_s']:.1f} items/s against "
          f"the base model's {entry['w1_base']['items_per_s']:.1f} ({entry['w1_ratio']:.2f}x); W2 with one adapter "
          f"{entry['w2_adapter']['items_per_s']:.1f} against {entry['w2_base']['items_per_s']:.1f} "
          f"({entry['w2_ratio']:.2f}x)", flush=True)
    return entry
