"""What a user would otherwise write: transformers (PyTorch) scoring the same token IDs on the same weights.

Two baselines, on CUDA when PyTorch sees a GPU, else on the CPU:
- `score_full`: each request as left-padded batches of full sequences, `logits_to_keep=1`;
- `score_prefix_cached`: the way an expert scores many continuations of one long query: the query's KV cache
  computed once, repeated over a batch of items, the items run against it (right-padded), the vocabulary
  projection only at each item's last token.
Both return log P(label | sequence) [items, labels] as NumPy float32; `token_logprobs` computes what
/v1/completions echoes. Used by `scorefn bench` only. PyTorch (and transformers' PyTorch models) are a test-only
dependency: they are imported when a baseline is built, so the roofline and the CPU bench without baselines run
without them.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any
from pathlib import Path

from runtime.model.gguf import GGUF_WEIGHTS


def _pretrained(model_dir: Path) -> dict[str, str]:
    """from_pretrained's arguments for a model directory. A directory prepared from a GGUF file keeps its weights in
    that file (runtime.model.gguf), so transformers reads the same file."""
    table = model_dir / GGUF_WEIGHTS
    if not table.is_file():
        return {"pretrained_model_name_or_path": str(model_dir)}
    gguf = Path(json.loads(table.read_text())["gguf"])
    return {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}


class TorchScorer:
    def __init__(self, model_dir: Path, dtype: str, pad_id: int, batch: int = 64):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_flush_denormal(True)  # dequantized GGUF weights hold denormals: 10x slower without it
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)
        else:
            torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here too
        self.pad_id = pad_id
        self.batch = batch  # rows per forward: bounds the activations (and, with a prefix, the copied cache)
        self.model = AutoModelForCausalLM.from_pretrained(**_pretrained(Path(model_dir)),
                                                          dtype=getattr(torch, dtype)).eval()
        self.model.to(self.device)

    def _sync(self, values):
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return values

    def score_full(self, sequences: list[list[int]], labels: list[int]):
        torch = self.torch
        out = []
        for start in range(0, len(sequences), self.batch):
            chunk = sequences[start:start + self.batch]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):  # left padding: the last position is every row's last token
                ids[row, width - len(seq):] = torch.tensor(seq)
                mask[row, width - len(seq):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                    logits_to_keep=1).logits
                out.append(torch.log_softmax(logits[:, -1].float(), dim=-1)[:, labels])
        return self._sync(torch.cat(out).cpu().numpy())

    def score_prefix_cached(self, query: list[int], items: list[list[int]], labels: list[int]):
        """query + item for each item, the query's KV cache computed once and reused for every batch of items."""
        return self.score_after_prefix(self.prefix(query), items, labels)

    def prefix(self, query: list[int]) -> tuple[Any, int]:
        """A prompt's past_key_values and its length: what an expert keeps to score many inputs after it."""
        with self.torch.inference_mode():
            ids = self.torch.tensor([query], device=self.device)
            return self.model(input_ids=ids, use_cache=True).past_key_values, len(query)

    def score_after_prefix(self, prefix: tuple[Any, int], items: list[list[int]], labels: list[int]):
        """Each item after a prefix (`prefix()`), the prefix's KV cache copied for every batch of items."""
        torch = self.torch
        cache, C = prefix
        out = []
        with torch.inference_mode():
            for start in range(0, len(items), self.batch):
                chunk = items[start:start + self.batch]
                width = max(len(item) for item in chunk)
                ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), C + width), dtype=torch.long)
                mask[:, :C] = 1
                for row, item in enumerate(chunk):  # right padding: the cache's positions stay put
                    ids[row, :len(item)] = torch.tensor(item)
                    mask[row, C:C + len(item)] = 1
                rows_cache = copy.deepcopy(cache)
                rows_cache.batch_repeat_interleave(len(chunk))
                positions = torch.arange(C, C + width).expand(len(chunk), width)
                hidden = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          position_ids=positions.to(self.device), past_key_values=rows_cache,
                                          use_cache=True).last_hidden_state
                last = torch.tensor([len(item) - 1 for item in chunk], device=self.device)
                logits = self.model.lm_head(hidden[torch.arange(len(chunk), device=self.device), last])
                out.append(torch.log_softmax(logits.float(), dim=-1)[:, labels])
        return self._sync(torch.cat(out).cpu().numpy())


    def _label_sums(self, hidden, logits_at, labels_rows):
        """Each row's label tokens' log-probabilities summed: hidden [R, T, D], logits_at [R] the position whose
        logits predict the row's first label token, labels_rows [R] the labels' tokens."""
        torch = self.torch
        sums = []
        for row, label in enumerate(labels_rows):
            positions = torch.arange(len(label), device=self.device) + int(logits_at[row])
            logprobs = torch.log_softmax(self.model.lm_head(hidden[row, positions]).float(), dim=-1)
            sums.append(logprobs[torch.arange(len(label), device=self.device),
                                 torch.tensor(label, device=self.device)].double().sum())
        return torch.stack(sums)

    def score_labels_full(self, prompts: list[list[int]], labels: list[list[int]]):
        """What a script does for labels of several tokens without a cache: every (prompt, label) sequence in
        full, right-padded batches, the vocabulary head only at the label's positions. [prompts, labels]."""
        torch = self.torch
        pairs = [(prompt, label) for prompt in prompts for label in labels]
        out = []
        with torch.inference_mode():
            for start in range(0, len(pairs), self.batch):
                chunk = pairs[start:start + self.batch]
                rows = [prompt + label[:-1] for prompt, label in chunk]
                ids, mask = self._right_padded(rows)
                hidden = self.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
                out.append(self._label_sums(hidden, [len(prompt) - 1 for prompt, _ in chunk],
                                            [label for _, label in chunk]))
        return self._sync(torch.cat(out).cpu().numpy().reshape(len(prompts), len(labels)))

    def score_labels_prompt_cached(self, prompts: list[list[int]], labels: list[list[int]]):
        """The same with each prompt's KV cache computed once and reused for its labels' rows (one batch of
        len(labels) rows per prompt)."""
        torch = self.torch
        out = []
        with torch.inference_mode():
            for prompt in prompts:
                C = len(prompt)
                first = self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True)
                cache, last = first.past_key_values, first.logits[0, -1].float()
                cache.batch_repeat_interleave(len(labels))
                rows = [label[:-1] or [self.pad_id] for label in labels]
                ids, suffix_mask = self._right_padded(rows)
                mask = torch.cat([torch.ones((len(rows), C), dtype=torch.long, device=self.device), suffix_mask], 1)
                positions = torch.arange(C, C + ids.shape[1], device=self.device).expand(len(rows), -1)
                hidden = self.model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                          past_key_values=cache, use_cache=True).last_hidden_state
                first_logprobs = torch.log_softmax(last, dim=-1)
                sums = []
                for row, label in enumerate(labels):
                    total = first_logprobs[label[0]].double()
                    if len(label) > 1:
                        logprobs = torch.log_softmax(self.model.lm_head(hidden[row, :len(label) - 1]).float(), -1)
                        total = total + logprobs[torch.arange(len(label) - 1, device=self.device),
                                                 torch.tensor(label[1:], device=self.device)].double().sum()
                    sums.append(total)
                out.append(torch.stack(sums))
        return self._sync(torch.stack(out).cpu().numpy())

    def _right_padded(self, rows: list[list[int]]):
        torch = self.torch
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        return ids.to(self.device), mask.to(self.device)

    def token_logprobs(self, sequences: list[list[int]], top_k: int):
        """Every position's next-token log-probability and top_k alternatives (what /v1/completions echoes),
        right-padded batches, the float32 log-softmax over the vocabulary per batch."""
        torch = self.torch
        out = []
        with torch.inference_mode():
            for start in range(0, len(sequences), self.batch):
                ids, mask = self._right_padded(sequences[start:start + self.batch])
                logprobs = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
                chosen = logprobs[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
                top = logprobs.topk(top_k, dim=-1)
                out.append((chosen.cpu(), top.indices.cpu(), top.values.cpu()))
        return self._sync(out)


def random_checkpoint(config_path: str | Path, out_dir: Path) -> Path:
    """A Hugging Face directory with seeded random weights for a config.json, saved in bfloat16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(config_path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir
