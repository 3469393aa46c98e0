"""POST /v1/rerank (also /v2/rerank and /rerank; the Cohere v2 / Jina / vLLM shape): validation and the response.

Each document is put with the query into the reranker's template and the pair scored with one prefill, read at
its last token: the (yes, no) verbalizer tokens' log-probabilities, or a one-label head's logit. The query comes
first in every template, so a request's pairs share their leading tokens and the engine's shared-prefix path
computes them once.

Order: query (missing, type, empty), documents (missing, type, empty), top_n, return_documents,
max_tokens_per_doc, model, cache_salt; then too_many_items, and after tokenization empty_sequence,
context_length_exceeded, too_many_tokens. A JSON null counts as the field being absent.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import msgspec
import numpy as np

from handler import schemas
from handler.errors import ERRORS, ErrorSpec
from handler.http import Scoring, cached, label_values, submit_labels
from handler.validation import (cache_salt, check_count, check_sequence, check_total_tokens, optional, required,
                                select_named)
from runtime.interface import ScoreResult, ScoringEngine
from runtime.probability import sigmoid
from runtime.settings import Settings
from runtime.tasks.rerankers import Reranker


@dataclasses.dataclass(frozen=True)
class RerankJob:
    """A validated /v1/rerank request, ready for the engine."""
    sequences: list[list[int]]  # one query-document pair per document, in document order
    label_ids: list[int | tuple[int, ...]]  # the reranker's yes/no words (a tuple: several tokens)
    reranker: Reranker
    documents: list[str]  # as given (returned with return_documents)
    top_n: int
    return_documents: bool
    model: str  # the reranker's id (or the LoRA adapter's name), answered as `model`
    n_tokens: int  # usage.prompt_tokens
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    cache_salt: str | None = None  # the prefix cache's (runtime.requests.prefix_cache)


def validate_rerank_request(request: schemas.RerankRequest, engine: ScoringEngine, settings: Settings) -> RerankJob:
    query = _query(request.query)
    documents = _documents(request.documents)
    top_n = _positive(request.top_n, ERRORS.invalid_top_n_type, ERRORS.invalid_top_n, len(documents))
    return_documents = optional(request.return_documents, bool, ERRORS.invalid_return_documents_type, True)
    max_tokens = _positive(request.max_tokens_per_doc, ERRORS.invalid_max_tokens_per_doc_type,
                           ERRORS.invalid_max_tokens_per_doc, None)
    reranker, adapter = _reranker(request.model, engine)
    salt = cache_salt(request.cache_salt)

    check_count(len(documents), settings.max_items, "documents")
    sequences = [_pair(index, query, document, reranker, engine, max_tokens)
                 for index, document in enumerate(documents)]
    n_tokens = check_total_tokens(sequences, settings.max_total_tokens, "query-document pairs", "documents")
    return RerankJob(sequences, list(reranker.label_ids), reranker, documents, min(top_n, len(documents)),
                     return_documents, adapter or reranker.name, n_tokens, adapter, salt)


def relevance(values: np.ndarray, reranker: Reranker) -> np.ndarray:
    """Relevance in [0, 1] per pair, float64 on the host: sigmoid(lp_yes - lp_no) = P(yes) / (P(yes) + P(no)),
    or sigmoid(logit) of a one-label head."""
    values = values.astype(np.float64)
    margin = values[:, 0] - values[:, 1] if reranker.is_verbalizer else values[:, 0]
    return sigmoid(margin)


def rerank_response(job: RerankJob, result: ScoreResult, engine: ScoringEngine) -> schemas.RerankResponse:
    values = label_values(job, result)  # [documents, labels]
    scores = relevance(values, job.reranker).tolist()
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: job.top_n]  # ties: the earlier document
    results = [schemas.RerankResult(index=i, relevance_score=scores[i], document=schemas.RerankDocument(
        text=job.documents[i]) if job.return_documents else msgspec.UNSET) for i in order]
    return schemas.RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=job.model, results=results,
                                  usage=schemas.RerankUsage(
                                      prompt_tokens=job.n_tokens, total_tokens=job.n_tokens,
                                      prompt_tokens_details=cached(result)))


RERANK = Scoring(schemas.RERANK_REQUEST_DECODER, validate_rerank_request, submit_labels, rerank_response)


def reranker_cards(engine: ScoringEngine, cards: list[schemas.ModelCard], created: int) -> list[schemas.ModelCard]:
    """GET /v1/models: a one-label classification model that is itself a reranker says so; then each reranker."""
    own = any(r.name == engine.model_id for r in engine.rerankers)
    cards = [msgspec.structs.replace(card, task="rerank") if own and card.id == engine.model_id else card
             for card in cards]
    return cards + [schemas.ModelCard(id=r.name, created=created, parent=engine.model_id, task="rerank")
                    for r in engine.rerankers if r.name != engine.model_id]


# ---- fields ---------------------------------------------------------------------------------------------

def _query(raw: msgspec.Raw) -> str:
    query = required(raw, str, ERRORS.missing_query, ERRORS.invalid_query_type)
    if not query.strip():
        raise ERRORS.blank_query()
    return query


def _documents(raw: msgspec.Raw) -> list[str]:
    documents = required(raw, list[str | schemas.TextDocument], ERRORS.missing_documents,
                         ERRORS.invalid_documents_type, "a list of strings or of objects with a string `text`")
    if not documents:
        raise ERRORS.empty_documents()
    return [d if isinstance(d, str) else d.text for d in documents]


def _positive(raw: msgspec.Raw, wrong_type: ErrorSpec, not_positive: ErrorSpec, default: Any) -> Any:
    value = optional(raw, int, wrong_type, None)
    if value is None:
        return default
    if value < 1:
        raise not_positive(value=value)
    return value


def _reranker(raw: msgspec.Raw, engine: ScoringEngine) -> tuple[Reranker, str | None]:
    return select_named(raw, engine.rerankers, engine, "reranker", ERRORS.no_reranker)


def _pair(index: int, query: str, document: str, reranker: Reranker, engine: ScoringEngine,
          max_tokens: int | None) -> list[int]:
    if max_tokens is not None:
        document = reranker.cut(document, max_tokens)  # Cohere's max_tokens_per_doc: the document's first tokens
    # The pair is rendered, then tokenized as a whole (as vLLM and the reranker's training data do).
    sequence = list(engine.tokenize(reranker.render(query, document), add_special_tokens=reranker.add_special_tokens))
    check_sequence(sequence, f"documents[{index}]", "the query-document pair", "documents", engine,
                   ERRORS.pair_too_long)
    return sequence
