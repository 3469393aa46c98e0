"""Every compiled program, declared once: its name, what the numbers of its buckets mean, its arguments' shapes
and dtypes, how a device mesh splits them, and what one device batch of it computes.

A program is compiled once per bucket (a tuple of sizes, named by `dims`) and called by name; serving
(runtime.requests.scorer, through a bucket layout), sharding (runtime.assembly.sharding), the executables and their
store, `scorefn compile`, the cost model and the roofline all read it from here. A new entry point is a method of
runtime.model.transformer.Transformer, one declaration below, and its binding to that method in
runtime.assembly.entry_points (this module is pure Python, so it names no model function). Arguments are (shape,
dtype) pairs.

Sharding roles: "batch" (rows split over the mesh's data axis), "kv" (a shared prefix's keys and values
[Layers, C, K, E], split by KV heads when those are), "rep" (replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

ArgSpec = tuple[tuple[int, ...], str]  # (shape, dtype name)
KINDS = ("full", "context", "continuation", "completion", "head")  # what a device batch is, for the cost model


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What argument shapes need from the model: its layers, KV heads, head and hidden sizes, the dtype of the
    shared-prefix keys and values (the attention dtype), and the label tokens a row's tail is read at (targets)."""
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    attention_dtype: str
    tail: int = 1

    @classmethod
    def of(cls, cfg: Any, attention_dtype: str, tail: int = 1) -> "ModelShapes":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, str(attention_dtype), tail)

    def targets(self, rows: int) -> "ArgSpec":
        """Each read row's label tokens, right-aligned on its last positions (-1: none) [rows, tail]."""
        return (rows, self.tail), "int32"

    def kv(self, context: int) -> ArgSpec:
        return (self.layers, context, self.kv_heads, self.head_dim), self.attention_dtype


@dataclasses.dataclass(frozen=True)
class Program:
    name: str  # the executables' name for it (and its model method's: runtime.assembly.entry_points binds them)
    dims: tuple[str, ...]  # what each size of a bucket is
    kind: str  # one of KINDS
    arg_roles: tuple[str, ...]
    out_roles: Any  # a role, or a tuple of roles for several outputs
    _args: Callable[[dict[str, int], ModelShapes], tuple[ArgSpec, ...]]
    # (rows, width, context) one device batch computes: rows of `width` token positions, each also attending
    # `context` keys of a shared prefix; None for a head (it reads pooled rows, not a forward pass).
    _geometry: Callable[[dict[str, int]], tuple[int, int, int]] | None = None
    every_position: bool = False  # the vocabulary head at every position (per-position log-probabilities)

    def sizes(self, bucket: tuple[int, ...]) -> dict[str, int]:
        if len(bucket) != len(self.dims):
            raise ValueError(f"{self.name} buckets are {self.dims}, got {bucket}")
        return dict(zip(self.dims, bucket))

    def args(self, bucket: tuple[int, ...], model: ModelShapes) -> tuple[ArgSpec, ...]:
        return self._args(self.sizes(bucket), model)

    def geometry(self, bucket: tuple[int, ...]) -> tuple[int, int, int]:
        """(rows, width, context) of one device batch of this bucket: rows of `width` token positions, each also
        attending `context` keys of a shared prefix; (rows, 0, 0) for a head."""
        if self._geometry is None:
            return self.sizes(bucket)["batch"], 0, 0
        return self._geometry(self.sizes(bucket))

    def tokens(self, bucket: tuple[int, ...]) -> int:
        """Token positions one device batch of this bucket computes, padding included (0 for a head)."""
        rows, width, _ = self.geometry(bucket)
        return rows * width

    def cost(self, bucket: tuple[int, ...], cfg: Any, weight_bytes: int, lora_columns: int = 0) -> tuple[float, float]:
        """(FLOPs, bytes) of one device batch from the model's shapes: matmuls and attention as computed (padding
        included); the weights read once, the context's keys and values, activations written and read once per
        matmul (bfloat16). `lora_columns`: LoRA slots x rank (runtime.model.lora: every projection's update runs
        for every slot). What a device at its peak would need: the roofline's upper bounds."""
        L, H, K, E, D, V = (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                            cfg.vocab_size)
        sizes = self.sizes(bucket)
        if self._geometry is None:  # a head over pooled rows
            rows, outputs = sizes["batch"], sizes.get("labels", 1)
            return 2.0 * D * V * rows, V * D * 4 + rows * (D + outputs) * 4
        rows, width, context = self._geometry(sizes)
        tokens = rows * width
        pair = 4.0 * L * H * E  # one query-key pair: scores and weighted values, every layer
        flops = tokens * 2.0 * cfg.non_embedding_params() + pair * (rows * width * width / 2 + tokens * context)
        traffic = weight_bytes + context * 2 * L * K * E * 2 + tokens * D * 2 * 7 * L * 2  # 7 matmuls, in and out
        if lora_columns:  # x @ A_all [I, columns], then @ B_all [columns, O], for each projection (I + O summed)
            widths = 2 * (D + H * E) + 2 * (D + K * E) + (0 if cfg.num_experts else 3 * (D + cfg.intermediate_size))
            flops += tokens * 2.0 * lora_columns * widths * L
            traffic += lora_columns * widths * L * 2
        if self.every_position:
            flops += 2.0 * D * V * tokens
            traffic += V * D * 4
        return flops, traffic


def _tokens(rows: int, width: int) -> ArgSpec:
    return (rows, width), "int32"


def _index(rows: int) -> ArgSpec:
    return (rows,), "int32"


def _packed(s: dict[str, int], m: ModelShapes) -> tuple[ArgSpec, ...]:
    """tokens, positions, segments [rows, width], each sequence's last token [slots], their label tokens' targets
    [slots, tail] and each token's LoRA adapter [rows, width] of packed rows."""
    return _tokens(s["rows"], s["width"]), _tokens(s["rows"], s["width"]), _tokens(s["rows"], s["width"]), \
        _index(s["slots"]), m.targets(s["slots"]), _tokens(s["rows"], s["width"])


def _context(s: dict[str, int], m: ModelShapes) -> tuple[ArgSpec, ...]:
    """A shared prefix's keys and values and its length."""
    return m.kv(s["context"]), m.kv(s["context"]), ((), "int32")


PROGRAMS: dict[str, Program] = {p.name: p for p in (
    # Every forward pass takes each row's LoRA adapter (runtime.model.lora; 0: the base model) last: per row, or
    # per token in packed rows. A model without adapters ignores it. Those read at one position per sequence also
    # take each sequence's targets (multi-token labels: the label's tokens on its last positions) and return beside
    # the pooled state the targets' log-probabilities (computed only when a row has any).
    # whole right-padded sequences [batch, length] -> the final-normed hidden state at each row's last token
    Program("hidden", ("batch", "length"), "full", ("batch", "batch", "batch", "batch"), ("batch", "batch"),
            lambda s, m: (_tokens(s["batch"], s["length"]), _index(s["batch"]), m.targets(s["batch"]),
                          _index(s["batch"])),
            lambda s: (s["batch"], s["length"], 0)),
    # a shared prefix [1, context] -> its keys and values in every layer
    Program("prefill_context", ("context",), "context", ("rep", "rep"), ("kv", "kv"),
            lambda s, m: (_tokens(1, s["context"]), _index(1)),
            lambda s: (1, s["context"], 0)),
    # a cached prefix's keys and values extended by the tokens after it [1, length] (the prefix cache keeps both)
    Program("extend_context", ("context", "length"), "context", ("kv", "kv", "rep", "rep", "rep"), ("kv", "kv"),
            lambda s, m: (*_context(s, m), _tokens(1, s["length"]), _index(1)),
            lambda s: (1, s["length"], s["context"])),
    # items after a shared prefix [batch, length], attending its keys and values
    Program("hidden_after_context", ("context", "batch", "length"), "continuation",
            ("kv", "kv", "rep", "batch", "batch", "batch", "batch"), ("batch", "batch"),
            lambda s, m: (*_context(s, m), _tokens(s["batch"], s["length"]), _index(s["batch"]), m.targets(s["batch"]),
                          _index(s["batch"])),
            lambda s: (s["batch"], s["length"], s["context"])),
    # several whole sequences per row [rows, width], `slots` sequences read
    Program("hidden_packed", ("rows", "width", "slots"), "full", ("batch", "batch", "batch", "rep", "rep", "batch"),
            ("batch", "batch"),
            lambda s, m: _packed(s, m),
            lambda s: (s["rows"], s["width"], 0)),
    Program("hidden_packed_after_context", ("context", "rows", "width", "slots"), "continuation",
            ("kv", "kv", "rep", "batch", "batch", "batch", "rep", "rep", "batch"), ("batch", "batch"),
            lambda s, m: (*_context(s, m), *_packed(s, m)),
            lambda s: (s["rows"], s["width"], s["context"])),
    # the vocabulary head on pooled rows [batch, hidden] for `labels` label tokens a row
    Program("label_logprobs", ("batch", "labels"), "head", ("batch", "batch"), "batch",
            lambda s, m: (((s["batch"], m.hidden), "float32"), ((s["batch"], s["labels"]), "int32"))),
    # a classification LoRA adapter's own head on pooled rows, per row's adapter (runtime.model.lora)
    Program("lora_class_logits", ("batch",), "head", ("batch", "batch"), "batch",
            lambda s, m: (((s["batch"], m.hidden), "float32"), _index(s["batch"]))),
    # a sequence-classification head on pooled rows
    Program("class_logits", ("batch",), "head", ("batch",), "batch",
            lambda s, m: (((s["batch"], m.hidden), "float32"),)),
    # every position's log-probabilities of whole sequences (tokens, lengths, temperature, seed)
    Program("token_logprobs", ("batch", "length"), "completion", ("batch", "batch", "batch", "batch", "batch"),
            ("batch", "batch", "batch", "batch", "batch"),
            lambda s, m: (_tokens(s["batch"], s["length"]), _index(s["batch"]), ((s["batch"],), "float32"),
                          ((s["batch"],), "uint32"), _index(s["batch"])),
            lambda s: (s["batch"], s["length"], 0), every_position=True),
    # a prompt [1, context] read at every position (as token_logprobs) and its keys and values kept (the prefix cache)
    Program("token_logprobs_context", ("context",), "completion", ("rep",) * 5,
            ("kv", "kv", "rep", "rep", "rep", "rep", "rep"),
            lambda s, m: (_tokens(1, s["context"]), _index(1), ((1,), "float32"), ((1,), "uint32"), _index(1)),
            lambda s: (1, s["context"], 0), every_position=True),
    # token_logprobs of rows after a cached prompt's first context tokens, attending its keys and values
    Program("token_logprobs_after_context", ("context", "batch", "length"), "completion",
            ("kv", "kv", "rep", "batch", "batch", "batch", "batch", "batch"),
            ("batch", "batch", "batch", "batch", "batch"),
            lambda s, m: (*_context(s, m), _tokens(s["batch"], s["length"]), _index(s["batch"]),
                          ((s["batch"],), "float32"), ((s["batch"],), "uint32"), _index(s["batch"])),
            lambda s: (s["batch"], s["length"], s["context"]), every_position=True),
)}
