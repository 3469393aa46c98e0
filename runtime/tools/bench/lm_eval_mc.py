"""lm-evaluation-harness itself against `scorefn serve`, with the prefix cache and without: its `local-completions`
model on a multiple-choice task (the 12 questions of tests/e2e/lm_eval_tasks, a 300-token instruction as the task's
description before each, so that every prompt is one the cache keeps), one request at a time, a fresh server for each
run as an evaluation meets. The run's seconds both ways, the accuracy both ways, and whether every log-likelihood is
equal. lm-eval is a test dependency, and the questions live in the repository: where either is missing (an installed
package, the image) the workload says so and is skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from runtime.tools.serverproc import ServerProcess

QUESTIONS = Path(__file__).resolve().parents[3] / "tests" / "e2e" / "lm_eval_tasks" / "multiple_choice.jsonl"
TASK = "scorefn_mc_instructed"
INSTRUCTION = ("Read the question carefully. Think about geography, science and history. Each question has four "
               "choices; exactly one of them is right. Pick the choice that completes the sentence best, as an expert "
               "would, without guessing wildly. ") * 6  # about 300 tokens


def run_lm_eval(model_dir: Path, dtype: str, quick: bool) -> dict:
    """Prints its line; {} (and why) when lm-eval or the questions are not here."""
    if importlib.util.find_spec("lm_eval") is None or not QUESTIONS.is_file():
        print("lm-eval multiple choice: skipped (lm-eval, a test dependency, or the repository's questions missing)")
        return {}
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder = Path(tempfile.mkdtemp(prefix="scorefn-lm-eval-"))
    task = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(QUESTIONS)}},
            "test_split": "test", "output_type": "multiple_choice", "description": INSTRUCTION,
            "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc"}]}
    (folder / f"{TASK}.yaml").write_text(json.dumps(task))  # YAML reads JSON
    os.environ.update(HF_DATASETS_CACHE=str(folder / "datasets"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    tasks = TaskManager(include_path=str(folder))
    sides = {"cache": "auto", "no_cache": "0"}
    out: dict = {name: {"seconds": []} for name in sides}
    for _ in range(1 if quick else 3):
        for name, cache in sides.items():  # alternating, each run on a fresh server
            env = {"SCOREFN_PREFIX_CACHE_BYTES": cache, "SCOREFN_DTYPE": dtype, "SCOREFN_MAX_WAIT_S": "600"}
            with ServerProcess(env=env) as server:
                with urllib.request.urlopen(f"{server.url}/v1/models") as models:  # the id it serves the model as
                    model_id = json.load(models)["data"][0]["id"]
                started = time.perf_counter()
                result = lm_eval.simple_evaluate(
                    model="local-completions", tasks=[TASK], task_manager=tasks, log_samples=True, batch_size=1,
                    model_args={"model": model_id, "base_url": f"{server.url}/v1/completions",
                                "tokenizer_backend": "huggingface", "tokenizer": str(model_dir),
                                "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
                                "max_length": 2048})
                out[name]["seconds"].append(time.perf_counter() - started)
            samples = sorted(result["samples"][TASK], key=lambda sample: sample["doc_id"])
            out[name]["accuracy"] = result["results"][TASK]["acc,none"]
            out[name]["loglikelihoods"] = [response[0] for sample in samples for response in sample["resps"]]
    entry: dict = {name: {"seconds": side["seconds"], "median_s": statistics.median(side["seconds"]),
                          "accuracy": side["accuracy"]} for name, side in out.items()}
    entry["cache_vs_none"] = entry["no_cache"]["median_s"] / entry["cache"]["median_s"]
    entry["same_loglikelihoods"] = out["cache"]["loglikelihoods"] == out["no_cache"]["loglikelihoods"]
    print(f"lm-eval multiple choice ({len(out['cache']['loglikelihoods'])} log-likelihoods, local-completions, a "
          f"fresh server per run): {entry['cache']['median_s']:.1f} s with the prefix cache, "
          f"{entry['no_cache']['median_s']:.1f} s without ({entry['cache_vs_none']:.2f}x); accuracy "
          f"{entry['cache']['accuracy']:.3f} / {entry['no_cache']['accuracy']:.3f}; same log-likelihoods: "
          f"{entry['same_loglikelihoods']}", flush=True)
    return entry
