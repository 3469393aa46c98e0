"""`scorefn bench`: scorefn against what a user would otherwise write, on this machine, same weights, same run.

Model: SCOREFN_MODEL (default: the embedded SmolLM2-135M-Instruct) on a CPU; on an accelerator (or with --model-config) seeded random
weights from a config.json, Qwen3-0.6B-shaped by default (runtime/model/configs/qwen3-0.6b.json). Token IDs are
generated (seeded, runtime.tools.workloads), so no tokenizer, GGUF file or model hub is needed: the runtime's
dependencies plus PyTorch. Baselines (runtime.tools.baselines, on CUDA when PyTorch sees a GPU): transformers
scoring full sequences, and transformers with a shared prefix's KV cache computed once and reused.
Every scorefn figure but W3 comes with `invariance_cost`: its time with the batch-invariant kernels over without
(SCOREFN_BATCH_INVARIANT), alternating runs in the same process.
MFU is against the device's matmul peak measured in the same run: bfloat16 on an accelerator; on a CPU the faster
of bfloat16 and float32 (without bfloat16 instructions float32 is the faster). The last output line is one JSON
summary.

One module per workload, in the order they run:

    scoring        W1 (latency and throughput: 1, 32 and 256 items per request) and W2 (one long query x many items)
    logprobs       W4 (every position's log-probability and top 5, as /v1/completions echoes them)
    adapters       LoRA (adapters mixed in one device round against the base model)
    rerank         W5 (reranking, prefix sharing on and off)
    choice         W6 (multiple choice: labels of several tokens as label rows)
    fewshot        W7 (a few-shot classifier: the prefix cache against none and transformers' past_key_values) and
                   W8 (lm-eval's multiple choice, read at every position: the prefix cache against none)
    paging         W9 (members' profiles paged after a cached instruction: the cache's extensions against none)
    batch_file     Batch (W1-256 lines through `scorefn batch` in process, against W1-256; the embedded model only)
    http_load      W3 (concurrent HTTP clients against one at a time, tracing on against off; the embedded model only)
    lm_eval_mc     lm-evaluation-harness's multiple choice through local-completions against `scorefn serve`, the
                   prefix cache against none (the embedded model, not --smoke; needs lm-eval, a test dependency)
    compile_times  --compile-times (warm-up cold and from the persistent cache, each in a fresh process: __main__)
and what they share: measure (timed runs, the invariance cost, summaries, the matmul peak, FLOPs) and run (the
model, the scorers and baselines, main(), the JSON summary, and --roofline, which needs no device).
"""

from runtime.tools.bench.run import main

__all__ = ["main"]
