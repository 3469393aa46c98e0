"""What /v1/rerank serves: yes/no verbalizer rerankers on a causal LM, or a one-label sequence-classification head.

A reranker renders a template around the query and one document and reads one prefill at the pair's last token:
- verbalizer (causal LM): the next-token log-probabilities of a `yes` and a `no` word;
  relevance = P(yes) / (P(yes) + P(no)) = sigmoid(lp_yes - lp_no), Qwen3-Reranker's formula;
- head (a `*ForSequenceClassification` checkpoint with one label): relevance = sigmoid(logit). Its default
  template is "{query}{document}": vLLM's pair for LLM-based rerankers (the two texts joined, no separator).
`{query}` must come before `{document}`: every pair of a request then starts with the same tokens, which the
shared-prefix path computes once for all documents. Declared in TOML (SCOREFN_RERANKERS; empty: BUILTIN_TOML on
a causal LM, the checkpoint itself on a one-label classification model):

    [[reranker]]
    name = "relevance"                # what `model` selects in a request
    template = "Query: {query}\\nDocument: {document}\\nRelevant:"   # {query} once, then {document} once
    yes = " yes"                      # causal LM only: one token each, checked at start-up
    no = " no"
    # chat = true                     # wrap the template in the model's chat template, as the user's message
    # assistant_prefix = "Answer:"    # with chat: text that follows the assistant header

Pure Python: the handler imports `Reranker`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from runtime.tasks import declarations

log = logging.getLogger("scorefn.runtime")

QUERY, DOCUMENT = "{query}", "{document}"
HEAD_TEMPLATE = QUERY + DOCUMENT  # vLLM's default pair for an LLM-based sequence-classification reranker

# The embedded default: relevance on SmolLM2-135M-Instruct. Of 13 wordings tried on the 8 cases of
# tests/runtime/tasks/test_rerank_models.py (a relevant passage, three unrelated ones), this one ranked every relevant
# passage first (24 of 24 pairs; without the chat template's system prompt 18 of 24, with " yes" / " no" 23).
# Short, so that pairs fit the 64-token buckets of the end-to-end tests.
BUILTIN_TOML = '''
[[reranker]]
name = "relevance"
template = "Query: {query}\\nDocument: {document}\\nIs the document relevant to the query? Answer yes or no."
chat = true
assistant_prefix = "Answer:"
yes = " Yes"
no = " No"
'''

_KEYS = {"name", "template", "yes", "no", *declarations.CHAT_KEYS}


class RerankerError(ValueError):
    """A reranker declaration that cannot be served (start-up fails with this message)."""


@dataclasses.dataclass(frozen=True)
class RerankerSpec:
    """A reranker as declared, before the served model's tokenizer is known."""
    name: str
    template: str
    yes: str = ""  # empty (both): read a classification head instead
    no: str = ""
    chat: bool = False
    assistant_prefix: str = ""


def _keep_all(text: str, max_tokens: int) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class Reranker:
    """A reranker ready to serve: what engine.submit needs and how to read its scores."""
    name: str
    prompt: str  # the rendered template: {query} once, then {document} once
    # submit()'s label_ids: the (yes, no) words' token IDs (or tokens' tuples), or (0,): the head's one logit
    label_ids: tuple[int | tuple[int, ...], ...]
    add_special_tokens: bool = True  # when tokenizing a pair (a chat-rendered prompt has its own)
    words: tuple[str, ...] = ()  # (yes, no); empty for a head
    # A document cut after its first n tokens (max_tokens_per_doc); built from the model's tokenizer.
    cut: Callable[[str, int], str] = dataclasses.field(default=_keep_all, compare=False, repr=False)

    @property
    def is_verbalizer(self) -> bool:
        return bool(self.words)

    def render(self, query: str, document: str) -> str:
        before, rest = self.prompt.split(QUERY)
        between, after = rest.split(DOCUMENT)
        return before + query + between + document + after


# ---- declarations ---------------------------------------------------------------------------------------

def parse_rerankers(text: str, source: str) -> tuple[RerankerSpec, ...]:
    """The rerankers a TOML document declares; RerankerError (naming `source`) for anything malformed."""
    return declarations.parse_tables(text, source, "reranker", _KEYS, RerankerError, _spec)


def _spec(table: dict, name: str, where: str) -> RerankerSpec:
    template = table.get("template")
    if not isinstance(template, str) or template.count(QUERY) != 1 or template.count(DOCUMENT) != 1:
        raise RerankerError(f"{where}: `template` must be a string containing {QUERY} once and {DOCUMENT} once")
    if template.index(QUERY) > template.index(DOCUMENT):
        raise RerankerError(f"{where}: {QUERY} must come before {DOCUMENT} in `template`, so that the query's "
                            "tokens are shared by every document of a request (computed once)")
    words = {key: table.get(key, "") for key in ("yes", "no")}
    for key, word in words.items():
        if not isinstance(word, str) or (key in table and not word):
            raise RerankerError(f"{where}: `{key}` must be a non-empty string")
    if bool(words["yes"]) != bool(words["no"]):
        raise RerankerError(f"{where}: declare both `yes` and `no` (a causal LM's verbalizer) or neither "
                            "(a sequence-classification model's one-label head)")
    chat, prefix = declarations.chat_options(table, where, RerankerError)
    return RerankerSpec(name, template, words["yes"], words["no"], chat, prefix)


def load_specs(path: str) -> tuple[RerankerSpec, ...]:
    """The rerankers declared in the TOML file at `path`; empty: the built-in ones."""
    return declarations.read(path, "SCOREFN_RERANKERS", BUILTIN_TOML, "reranker", parse_rerankers, RerankerError)


# ---- resolution against the served model -----------------------------------------------------------

def resolve(spec: RerankerSpec, tokenizer: Any, cfg: Any, max_labels: int, max_label_tokens: int) -> Reranker:
    """The reranker with its prompt rendered and its words as token IDs; RerankerError if it cannot be served."""
    where = f"reranker '{spec.name}'"
    head = cfg.task == "sequence_classification"
    if head and spec.yes:
        raise RerankerError(f"{where}: `yes` / `no` words need a causal language model, but the served model is a "
                            f"{cfg.architecture}: its one-label head gives the relevance (drop `yes` and `no`)")
    if not head and not spec.yes:
        raise RerankerError(f"{where}: declare a `yes` and a `no` word: a causal language model's relevance is "
                            "P(yes) / (P(yes) + P(no)) at the last position")
    prompt = declarations.render(spec.template, spec.chat, spec.assistant_prefix, tokenizer, where, RerankerError)
    if prompt.count(QUERY) != 1 or prompt.count(DOCUMENT) != 1:
        raise RerankerError(f"{where}: the chat template did not keep {QUERY} and {DOCUMENT} once each: {prompt!r}")
    if head:
        label_ids: tuple[int | tuple[int, ...], ...] = (0,)
    else:
        if max_labels < 2:
            raise RerankerError(f"{where}: reads 2 tokens, more than SCOREFN_MAX_LABELS={max_labels}")
        label_ids = tuple(declarations.verbalizer_tokens(word, tokenizer, cfg.vocab_size, max_label_tokens,
                                                         f"{where}: `{key}` word", RerankerError)
                          for key, word in (("yes", spec.yes), ("no", spec.no)))
        if label_ids[0] == label_ids[1]:
            raise RerankerError(f"{where}: `yes` {spec.yes!r} and `no` {spec.no!r} are the same tokens {label_ids[0]}")
    # Chat templates write their own special tokens (a BOS among them); tokenizing adds none then, as HF does.
    return Reranker(name=spec.name, prompt=prompt, label_ids=label_ids, add_special_tokens=not spec.chat,
                    words=(spec.yes, spec.no) if spec.yes else (), cut=document_cutter(tokenizer))


def document_cutter(tokenizer: Any) -> Callable[[str, int], str]:
    """text -> its beginning up to the end of its n-th token (tokenized alone, no special tokens); whole if shorter."""
    def cut(text: str, max_tokens: int) -> str:
        if getattr(tokenizer, "is_fast", False):  # cut the original text where the n-th token ends
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            return text if len(offsets) <= max_tokens else text[: offsets[max_tokens - 1][1]]
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    return cut


def build_rerankers(setting: str, cfg: Any, model_id: str, tokenizer: Any, max_labels: int, max_label_tokens: int,
                    taken: tuple[str, ...] = ()) -> tuple[Reranker, ...]:
    """The rerankers the engine serves, checked against the loaded model (called at start-up).

    `setting` is SCOREFN_RERANKERS; `taken`: the classifiers' names (every /v1/models id is unique). Declared
    rerankers that do not fit the model raise RerankerError; the built-in one is dropped with a warning instead
    (it is written for the embedded model).
    """
    if cfg.task == "sequence_classification":
        if cfg.num_labels != 1:
            if setting:
                raise RerankerError(f"SCOREFN_RERANKERS={setting}: a reranker on a sequence-classification model "
                                    f"reads a one-label head, but {cfg.architecture} '{model_id}' has "
                                    f"{cfg.num_labels} labels")
            return ()  # a classifier with several labels is not a reranker
        specs = load_specs(setting) if setting else (RerankerSpec(model_id, HEAD_TEMPLATE),)
    else:
        specs = load_specs(setting)
    try:
        clash = sorted({spec.name for spec in specs} & ({*taken, model_id} - {_own_name(cfg, model_id)}))
        if clash:
            raise RerankerError(f"reranker names {clash} are already model ids in GET /v1/models (the served model "
                                "or a classifier); rename them")
        return tuple(resolve(spec, tokenizer, cfg, max_labels, max_label_tokens) for spec in specs)
    except RerankerError as exc:
        if setting:
            raise
        log.warning("built-in reranker dropped (/v1/rerank has no reranker; declare one in SCOREFN_RERANKERS): %s",
                    exc)
        return ()


def _own_name(cfg: Any, model_id: str) -> str | None:
    # A one-label classification checkpoint is itself a reranker: it may keep its own id.
    return model_id if cfg.task == "sequence_classification" else None
