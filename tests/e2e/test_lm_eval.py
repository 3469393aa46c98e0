"""lm-evaluation-harness's `local-completions` model against a real scorefn server, on a multiple-choice task and a
perplexity (`loglikelihood_rolling`) task defined in tests/e2e/lm_eval_tasks (local JSONL, no hub): every
request's log-likelihood equals that of lm-eval's own `hf` model (transformers, float32, the same weights) to
1e-3, greediness agrees, and the accuracies are equal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.slow
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
MAX_LENGTH = 48  # tokens per rolling window; the e2e server's sequences go up to 64
TASK_CONFIGS = {
    "scorefn_multiple_choice": {
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}], "data": "multiple_choice.jsonl"},
    "scorefn_perplexity": {
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}], "data": "perplexity.jsonl"},
}


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory, monkeypatch_module):
    """The two tasks as lm-eval YAML, their data files named by absolute path; datasets read them offline."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, config in TASK_CONFIGS.items():
        config = dict(config)
        data = str(TASKS / config.pop("data"))
        document = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                    "test_split": "test", **config}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(document))
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def evaluate(task_manager, model: str, model_args: dict) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=sorted(TASK_CONFIGS),
                                   task_manager=task_manager, log_samples=True, batch_size=8)


def loglikelihoods(results: dict, task: str) -> list[tuple[float, bool]]:
    """Per request, in document then choice order: (log-likelihood, is greedy)."""
    out = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for response in sample["resps"]:
            value = response[0]
            out.append((value, True) if isinstance(value, float) else (float(value[0]), bool(value[1])))
    return out


def test_local_completions_equals_the_hf_model(server, embedded_dir, task_manager):
    import torch

    from runtime.model.gguf import embedded_gguf

    gguf = embedded_gguf()
    ours = evaluate(task_manager, "local-completions", {
        "model": "SmolLM2-135M-Instruct", "base_url": f"{server.url}/v1/completions",
        "tokenizer_backend": "huggingface", "tokenizer": str(embedded_dir), "tokenized_requests": True,
        "max_length": MAX_LENGTH + 2,  # the API model keeps 1 for the completion and 1 for the rolling context
        "num_concurrent": 1, "max_retries": 1})
    torch.set_flush_denormal(True)  # dequantized GGUF weights hold denormals: 10x slower without it
    try:
        # The same GGUF file the server dequantizes (its prepared directory holds no weights of its own).
        reference = evaluate(task_manager, "hf", {"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                                                   "tokenizer": str(embedded_dir), "dtype": "float32",
                                                   "max_length": MAX_LENGTH, "device": "cpu"})
    finally:
        torch.set_flush_denormal(False)
    for task in TASK_CONFIGS:
        got, expected = loglikelihoods(ours, task), loglikelihoods(reference, task)
        assert len(got) == len(expected) > 0
        np.testing.assert_allclose([g for g, _ in got], [e for e, _ in expected], atol=1e-3, rtol=0)
        assert [g for _, g in got] == [e for _, e in expected], task  # greediness, from the top tokens
    accuracy = ours["results"]["scorefn_multiple_choice"]["acc,none"]
    assert accuracy == reference["results"]["scorefn_multiple_choice"]["acc,none"] and accuracy >= 0.5
    ours_ppl = ours["results"]["scorefn_perplexity"]["word_perplexity,none"]
    assert ours_ppl == pytest.approx(reference["results"]["scorefn_perplexity"]["word_perplexity,none"], rel=1e-3)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
