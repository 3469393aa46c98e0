"""Every request and response body as a frozen msgspec Struct, with the encoder and decoders built once.

Request structs hold their fields as `msgspec.Raw` (the field's JSON text, undecoded), and each endpoint decodes
them one by one in RFC-006's order (handler.validation's `required`, `optional`, `decode_field`). Their
`extra_json_schema` documents the real types for OpenAPI. Unknown fields are ignored (msgspec's default); an
optional field given as null counts as absent.

No field is typed in the struct, not even a boolean: for every field, a type checked by msgspec while it
decodes the body would change which error some request gets, or its text (tests/handler pins them):
- msgspec stops at the first wrongly typed field in document order, before it has read the rest of the body:
  `{"apply_softmax": "x", "query": [` would be that field's error instead of invalid_json, and it would come
  before every check RFC-006 orders ahead of it (a missing `query`, an empty `items`, model_not_supported...);
- a key given twice counts once, the last value: `{"echo": 1, "echo": true}` is valid today, but a typed field
  fails on the first value;
- its error is one ValidationError for the whole body ("Expected `bool | null`, got `str` - at `$.echo`"),
  which decode_body answers as invalid_body_type, not as invalid_<field>_type with RFC-006's message;
- the input fields (`input`, `prompt`, /v1/score's `items`) cannot be typed at all: msgspec decodes no union
  of two list types (`list[str] | list[list[int]]`), and `[]` must be read in a fixed order.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
TOKEN_IDS = {"type": "array", "items": TOKEN_ID}


def _doc(description: str, **schema: Any) -> msgspec.Meta:
    return msgspec.Meta(description=description, extra_json_schema=schema)


MAX_CACHE_SALT_CHARS = 256
# Every scoring request's `cache_salt` (handler.validation.cache_salt checks it)
CacheSalt = Annotated[msgspec.Raw, _doc(
    "Prefixes are shared through the prefix cache only between requests with the same salt (none: the unsalted "
    "ones): one tenant's requests cannot find another's prompt cached.",
    type=["string", "null"], minLength=1, maxLength=MAX_CACHE_SALT_CHARS,
)]


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    query: Annotated[msgspec.Raw, _doc(
        "The context: text, or token IDs (then items must be token IDs too).",
        anyOf=[{"type": "string", "minLength": 1}, {**TOKEN_IDS, "minItems": 1}],
    )] = msgspec.UNSET
    items: Annotated[msgspec.Raw, _doc(
        "Candidate continuations, scored one by one after the query (or before it with item_first).",
        anyOf=[{"type": "array", "items": {"type": "string"}, "minItems": 1},
               {"type": "array", "items": TOKEN_IDS, "minItems": 1}],
    )] = msgspec.UNSET
    label_token_ids: Annotated[msgspec.Raw, _doc(
        "The labels scored after each item, in this order (duplicates allowed): a token ID (the next token's "
        "score), or a list of token IDs (a label of several tokens: the sum of their log-probabilities, each after "
        "the item and the label's tokens before it). Give this or `labels`.",
        type="array", items={"anyOf": [TOKEN_ID, {**TOKEN_IDS, "minItems": 1}]}, minItems=1,
    )] = msgspec.UNSET
    labels: Annotated[msgspec.Raw, _doc(
        "The labels as text (text mode only), each tokenized as a continuation (no special tokens added): scored as "
        "label_token_ids' lists. Give this or `label_token_ids`.",
        type="array", items={"type": "string", "minLength": 1}, minItems=1,
    )] = msgspec.UNSET
    label_normalization: Annotated[msgspec.Raw, _doc(
        "sum: a label's log-probability (its tokens' summed); mean: per token (the sum over its token count), to "
        "compare labels of different lengths.", enum=["sum", "mean", None], default="sum",
    )] = msgspec.UNSET
    return_token_logprobs: Annotated[msgspec.Raw, _doc(
        "Also return each label's tokens' log-probabilities (`token_logprobs`: [item][label][token]).",
        type=["boolean", "null"], default=False,
    )] = msgspec.UNSET
    apply_softmax: Annotated[msgspec.Raw, _doc(
        "false: log P(label | sequence) over the full vocabulary; true: softmax over the labels, per item.",
        type=["boolean", "null"], default=False,
    )] = msgspec.UNSET
    item_first: Annotated[msgspec.Raw, _doc(
        "Score item + query instead of query + item.", type=["boolean", "null"], default=False,
    )] = msgspec.UNSET
    model: Annotated[msgspec.Raw, _doc(
        "The served model's id (GET /v1/models); omitted or null: the served model.", type=["string", "null"],
    )] = msgspec.UNSET
    cache_salt: CacheSalt = msgspec.UNSET


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int = 0  # of prompt_tokens, those whose keys and values came from the prefix cache


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int  # sum of the lengths of every item's full sequence
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class ScoreResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "scoring"
    created: int
    model: str
    scores: list[list[float]]  # [item][label], labels in request order
    usage: Usage
    token_logprobs: list[list[list[float]]] | msgspec.UnsetType = msgspec.UNSET  # [item][label][token], when asked


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    text: Annotated[msgspec.Raw, _doc("Text to tokenize.", type="string")] = msgspec.UNSET
    add_special_tokens: Annotated[msgspec.Raw, _doc(
        "Add the tokenizer's special tokens (e.g. BOS).", type=["boolean", "null"], default=False,
    )] = msgspec.UNSET


class TokenizeResponse(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[int]
    count: int


class ClassifyRequest(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's classification request (handler.classify validates it)."""
    input: Annotated[msgspec.Raw, _doc(
        "What to classify: a text, a list of texts, token IDs, or a list of token-ID lists (none empty).",
        anyOf=[{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                                    "minItems": 1},
               {**TOKEN_IDS, "minItems": 1}, {"type": "array", "items": {**TOKEN_IDS, "minItems": 1}, "minItems": 1}],
    )] = msgspec.UNSET
    model: Annotated[msgspec.Raw, _doc(
        "A classifier's id (GET /v1/models); omitted or null: the first one.", type=["string", "null"],
    )] = msgspec.UNSET
    truncate_prompt_tokens: Annotated[msgspec.Raw, _doc(
        "Keep only the last N tokens of each prompt; -1: the longest supported length. Omitted: never truncate.",
        type=["integer", "null"], minimum=-1,
    )] = msgspec.UNSET
    use_activation: Annotated[msgspec.Raw, _doc(
        "true: probabilities (softmax; sigmoid for one-label and multi-label heads); false: raw scores.",
        type=["boolean", "null"], default=True,
    )] = msgspec.UNSET
    user: Annotated[msgspec.Raw, _doc("Accepted for compatibility; ignored.", type=["string", "null"])] = msgspec.UNSET
    rid: Annotated[msgspec.Raw, _doc("Accepted for compatibility; ignored.", type=["string", "null"])] = msgspec.UNSET
    priority: Annotated[msgspec.Raw, _doc("Accepted for compatibility; ignored.",
                                          type=["integer", "null"])] = msgspec.UNSET
    cache_salt: CacheSalt = msgspec.UNSET


class ClassifyData(msgspec.Struct, frozen=True, kw_only=True):
    index: int  # position in the request's input list
    label: str  # the label with the highest score
    probs: list[float]  # one per label, in the classifier's label order
    num_classes: int


class ClassifyResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str  # the classifier's id
    data: list[ClassifyData]
    usage: Usage


_TEXT_DOCUMENT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


class RerankRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The Cohere v2 / Jina / vLLM rerank request (handler.rerank validates it)."""
    query: Annotated[msgspec.Raw, _doc("The search query.", type="string", minLength=1)] = msgspec.UNSET
    documents: Annotated[msgspec.Raw, _doc(
        "The documents to rank against the query: strings, or objects with a `text` string.",
        type="array", items={"anyOf": [{"type": "string"}, _TEXT_DOCUMENT]}, minItems=1,
    )] = msgspec.UNSET
    top_n: Annotated[msgspec.Raw, _doc(
        "Return only the N most relevant documents; omitted or null: all of them.", type=["integer", "null"], minimum=1,
    )] = msgspec.UNSET
    return_documents: Annotated[msgspec.Raw, _doc(
        "Include each document's text in its result.", type=["boolean", "null"], default=True,
    )] = msgspec.UNSET
    max_tokens_per_doc: Annotated[msgspec.Raw, _doc(
        "Cut each document after this many of its tokens; omitted or null: never cut (a pair longer than the "
        "longest supported length is refused).", type=["integer", "null"], minimum=1,
    )] = msgspec.UNSET
    model: Annotated[msgspec.Raw, _doc(
        "A reranker's id (GET /v1/models); omitted or null: the first one.", type=["string", "null"],
    )] = msgspec.UNSET
    cache_salt: CacheSalt = msgspec.UNSET


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's legacy completions request, prefill only (handler.completions validates it)."""
    prompt: Annotated[msgspec.Raw, _doc(
        "A text, a list of texts, token IDs, or a list of token-ID lists (none empty); one choice per prompt.",
        anyOf=[{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1},
                                                    "minItems": 1},
               {**TOKEN_IDS, "minItems": 1}, {"type": "array", "items": {**TOKEN_IDS, "minItems": 1}, "minItems": 1}],
    )] = msgspec.UNSET
    max_tokens: Annotated[msgspec.Raw, _doc(
        "0 (score the prompt only) or 1 (also the one token after it, from the same prefill). Required: OpenAI's "
        "default of 16 would be generation, which this server does not do.", type="integer", minimum=0, maximum=1,
    )] = msgspec.UNSET
    echo: Annotated[msgspec.Raw, _doc("Return the prompt's tokens (and their log-probabilities) before the "
                                      "completion.", type=["boolean", "null"], default=False)] = msgspec.UNSET
    logprobs: Annotated[msgspec.Raw, _doc(
        "Per token, its log-probability and this many most likely alternatives (0-20); omitted: none.",
        type=["integer", "null"], minimum=0, maximum=20)] = msgspec.UNSET
    temperature: Annotated[msgspec.Raw, _doc(
        "0: the completion token is the most likely one; above 0: drawn at this temperature.",
        type=["number", "null"], minimum=0, maximum=2, default=1)] = msgspec.UNSET
    top_p: Annotated[msgspec.Raw, _doc("Only 1 (no nucleus truncation) is supported.", type=["number", "null"],
                                       minimum=1, maximum=1, default=1)] = msgspec.UNSET
    seed: Annotated[msgspec.Raw, _doc("Draws the same token for the same seed, prompt and model.",
                                      type=["integer", "null"])] = msgspec.UNSET
    stop: Annotated[msgspec.Raw, _doc(
        "Up to 4 strings: a completion containing one is cut before it (finish_reason \"stop\").",
        anyOf=[{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
               {"type": "null"}])] = msgspec.UNSET
    n: Annotated[msgspec.Raw, _doc("Only 1.", type=["integer", "null"], minimum=1, maximum=1,
                                   default=1)] = msgspec.UNSET
    best_of: Annotated[msgspec.Raw, _doc("Only 1.", type=["integer", "null"], minimum=1, maximum=1,
                                         default=1)] = msgspec.UNSET
    stream: Annotated[msgspec.Raw, _doc("Only false: a completion of at most one token is answered whole.",
                                        type=["boolean", "null"], default=False)] = msgspec.UNSET
    suffix: Annotated[msgspec.Raw, _doc("Only null or empty: insertion needs text after the completion, which a "
                                        "prefill of the prompt does not read.", type=["string", "null"],
                                        maxLength=0)] = msgspec.UNSET
    presence_penalty: Annotated[msgspec.Raw, _doc("Accepted; it cannot change the first token.",
                                                  type=["number", "null"], minimum=-2, maximum=2)] = msgspec.UNSET
    frequency_penalty: Annotated[msgspec.Raw, _doc("Accepted; it cannot change the first token.",
                                                   type=["number", "null"], minimum=-2, maximum=2)] = msgspec.UNSET
    user: Annotated[msgspec.Raw, _doc("Accepted for compatibility; ignored.", type=["string", "null"])] = msgspec.UNSET
    model: Annotated[msgspec.Raw, _doc(
        "The served model's id (GET /v1/models); omitted or null: the served model.", type=["string", "null"],
    )] = msgspec.UNSET
    cache_salt: CacheSalt = msgspec.UNSET


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]  # each token as the tokenizer decodes it alone
    token_logprobs: list[float | None]  # null for the first prompt token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None]  # the most likely tokens there, and the token itself
    text_offset: list[int]  # where each token starts in `text`, in characters


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int  # the prompt's position in the request
    text: str  # the completion (after the prompt with echo)
    finish_reason: str  # "length", or "stop" when a stop string cut the completion
    logprobs: CompletionLogprobs | None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TextDocument(msgspec.Struct, frozen=True):
    text: str  # other keys are ignored


class RerankDocument(msgspec.Struct, frozen=True, kw_only=True):
    text: str  # as given in the request


class RerankResult(msgspec.Struct, frozen=True, kw_only=True):
    index: int  # position in the request's documents
    relevance_score: float  # in [0, 1]
    document: RerankDocument | msgspec.UnsetType = msgspec.UNSET  # with return_documents


class RerankUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int  # every query-document pair's tokens, template included
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class RerankResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    model: str  # the reranker's id
    results: list[RerankResult]  # by relevance_score descending, ties by index; top_n of them
    usage: RerankUsage


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "scorefn"
    # The served model only: whether scores are bitwise the same whatever else is batched with them
    # (SCOREFN_BATCH_INVARIANT; its classifiers and rerankers run on it).
    batch_invariant: bool | msgspec.UnsetType = msgspec.UNSET
    dtype: str | msgspec.UnsetType = msgspec.UNSET  # the served model only: the number format scores are computed in
    # Classifiers, rerankers and LoRA adapters only (GET /v1/models lists the served model, each classifier, each
    # reranker, each adapter):
    parent: str | msgspec.UnsetType = msgspec.UNSET  # the served model a classifier, reranker or adapter runs on
    task: str | msgspec.UnsetType = msgspec.UNSET  # "classify", "rerank" or "lora"
    labels: list[str] | msgspec.UnsetType = msgspec.UNSET


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class Status(msgspec.Struct, frozen=True, kw_only=True):
    status: str  # /health: "ok"; /ready: "ready"


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorBody


# Built once: msgspec caches type information inside encoders/decoders.
ENCODER = msgspec.json.Encoder()
SCORE_REQUEST_DECODER = msgspec.json.Decoder(ScoreRequest)
TOKENIZE_REQUEST_DECODER = msgspec.json.Decoder(TokenizeRequest)
CLASSIFY_REQUEST_DECODER = msgspec.json.Decoder(ClassifyRequest)
RERANK_REQUEST_DECODER = msgspec.json.Decoder(RerankRequest)
COMPLETION_REQUEST_DECODER = msgspec.json.Decoder(CompletionRequest)

# Fields the request structs treat as optional only so that validation can say which one is missing.
REQUIRED_FIELDS: dict[type, tuple[str, ...]] = {
    ScoreRequest: ("query", "items"),
    TokenizeRequest: ("text",),
    ClassifyRequest: ("input",),
    RerankRequest: ("query", "documents"),
    CompletionRequest: ("prompt", "max_tokens"),
}
# Fields of which a request gives exactly one.
ONE_OF_FIELDS: dict[type, tuple[str, ...]] = {ScoreRequest: ("label_token_ids", "labels")}


def openapi_schema(struct_type: type) -> dict[str, Any]:
    """A self-contained JSON Schema (references inlined) of a struct, for an OpenAPI operation."""
    (root,), components = msgspec.json.schema_components([struct_type], ref_template="{name}")
    for name, required in ((t.__name__, fields) for t, fields in REQUIRED_FIELDS.items()):
        if name in components:
            components[name]["required"] = list(required)
    for name, fields in ((t.__name__, fields) for t, fields in ONE_OF_FIELDS.items()):
        if name in components:
            components[name]["oneOf"] = [{"required": [field]} for field in fields]

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(components[node["$ref"]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return inline(root)
