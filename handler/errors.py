"""The closed error taxonomy: every error the API can answer, declared once in ERRORS with its HTTP status, error
type and message; the engine's exceptions mapped onto it (ENGINE_ERRORS).

Bodies follow RFC-006 / OpenAI: `{"error": {"message", "type", "param", "code"}}`; `param` is null when no single
request field is at fault. Codes marked "reserved" are RFC-006 rows that DESIGN.md's decisions make unreachable
(`model` is optional; the one served model is always loaded) but keep in the contract.

A raise site names its entry and gives the message's fields: `raise ERRORS.too_many_tokens("items", what="sequences",
count=n, limit=limit)`. An entry's name is its code, but for a `worded` one: a situation its code answers in other
words (status, type and Retry-After are always the code's). As a mapping, ERRORS is code -> the code's first entry,
in the table's order (the docs' error page, OpenAPI and the tests read it so).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterator, Mapping

from runtime.interface import DeadlineExceeded, QueueFull, ShuttingDown

Headers = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorSpec:
    """One way a request fails: HTTP status, error type, the message (a str.format template: `{param}` is the field
    at fault, the other fields the raise site's) and Retry-After on answers that invite a retry (unless the error
    sets its own)."""
    status: int
    type: str
    message: str
    retry_after_s: int | None = None
    param: str | None = None  # the request field at fault, where it is always the same one
    of: ErrorSpec | None = None  # the entry whose code this one answers with (worded)
    name: str = dataclasses.field(default="", init=False)  # its name in ERRORS (ErrorSet sets it)

    @property
    def code(self) -> str:
        return self.name if self.of is None else self.of.code

    def worded(self, message: str, param: str | None = None) -> ErrorSpec:
        """The same code for another situation: another message, perhaps another field at fault."""
        return dataclasses.replace(self, message=message, param=param or self.param, of=self)

    def __call__(self, param: str | None = None, *, headers: Headers = (), **fields: object) -> ApiError:
        """The error to raise, its message filled in; `param` names the field at fault where the entry does not."""
        param = param or self.param
        return ApiError(self, self.message.format(param=param, **fields), param, headers)


class ErrorSet(Mapping[str, ErrorSpec]):
    """A table of errors: each entry an attribute (raise sites name it, its name its code); as a mapping, each code's
    first entry."""
    _codes: dict[str, ErrorSpec]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._codes = {}
        for name, entry in vars(cls).items():
            if isinstance(entry, ErrorSpec):
                if hasattr(Mapping, name):  # ERRORS.items would no longer be the mapping's
                    raise TypeError(f"an error cannot be named {name!r}")
                object.__setattr__(entry, "name", name)
                cls._codes.setdefault(entry.code, entry)

    def __getitem__(self, code: str) -> ErrorSpec:
        return self._codes[code]

    def __iter__(self) -> Iterator[str]:
        return iter(self._codes)

    def __len__(self) -> int:
        return len(self._codes)


MISSING, INVALID_VALUE, INVALID_REQUEST = "missing_parameter_error", "invalid_value_error", "invalid_request_error"
MODEL, SERVER = "model_error", "server_error"
INTERNAL_ERROR_MESSAGE = "An internal error occurred. Please try again."
# Messages of several codes
MUST_BE = "{param} must be {kind}"  # kind: how the field's type is named (handler.validation)
TOO_MANY = "{param} has {count} entries, more than the limit of {limit}."
BETWEEN = "{param} must be between {low} and {high}; got {value}."
POSITIVE = "{param} must be at least 1; got {value}."
ONE_CHOICE = "{param} must be {allowed}: one choice per prompt is returned; got {value}."
EMPTY_INPUTS = "{param} cannot be empty. At least one {param} is required."
INPUTS_KIND = "{param} must be a string, a list of strings, a list of token IDs or a list of token-ID lists"
INT64_IDS = "{param} token IDs must be integers within the signed 64-bit range"
TOO_LONG = "{where}: {what} has {length} tokens, more than the maximum sequence length of {limit} tokens."
ADAPTER_CLASSIFIES = "LoRA adapter '{model}' is a classifier (its own classification head)"


def _missing(field: str) -> ErrorSpec:
    return ErrorSpec(400, MISSING, "{param} is required", param=field)


def _wrong_type(field: str) -> ErrorSpec:
    return ErrorSpec(400, INVALID_REQUEST, MUST_BE, param=field)


class _Errors(ErrorSet):
    # RFC-006 rows first, in its order, then DESIGN.md's and this module's additions.
    # RFC-006: query
    missing_query = _missing("query")
    empty_query = ErrorSpec(400, INVALID_VALUE, "query cannot be empty", param="query")
    blank_query = empty_query.worded("query cannot be empty or whitespace only")  # /v1/rerank
    invalid_query_type = _wrong_type("query")
    # RFC-006: items
    missing_items = _missing("items")
    empty_items = ErrorSpec(400, INVALID_VALUE, "items cannot be empty. At least one item is required.", param="items")
    invalid_items_type = ErrorSpec(400, INVALID_REQUEST, "items must be a list of strings or list of token ID lists",
                                   param="items")
    mixed_input_types = ErrorSpec(400, INVALID_REQUEST, "query and items must both be text (str) or both be tokens "
                                  "(list[int]). Got query type: {query}, items[0] type: {items}", param="items")
    # RFC-006: label_token_ids (negative_token_id / token_id_exceeds_vocab also for token-mode query and items)
    missing_label_token_ids = _missing("label_token_ids")
    empty_label_token_ids = ErrorSpec(400, INVALID_VALUE, "label_token_ids cannot be empty. At least one label token "
                                      "ID is required.", param="label_token_ids")
    negative_token_id = ErrorSpec(400, INVALID_VALUE, "{param} cannot contain negative values. Got: {values}")
    token_id_exceeds_vocab = ErrorSpec(422, INVALID_VALUE, "{param} contains token ID {token} which exceeds vocabulary "
                                       "size {vocab_size} (valid IDs are 0 to {highest})")
    # RFC-006's messages (a label may also be a list of integers)
    invalid_label_token_ids_type = ErrorSpec(400, INVALID_REQUEST, "label_token_ids must be a list of integers",
                                             param="label_token_ids")
    invalid_token_id_type = ErrorSpec(400, INVALID_REQUEST, "label_token_ids must contain only integers",
                                      param="label_token_ids")
    label_id_beyond_int64 = invalid_token_id_type.worded(
        "label_token_ids must contain only integers (within the signed 64-bit range)")
    # /v1/score's labels of several tokens (label_token_ids' lists, or `labels` as text)
    conflicting_labels = ErrorSpec(400, INVALID_REQUEST, "give label_token_ids or labels, not both", param="labels")
    invalid_labels_type = ErrorSpec(400, INVALID_REQUEST, "labels must be a list of strings", param="labels")
    empty_labels = ErrorSpec(400, INVALID_VALUE, "labels cannot be empty. At least one label is required.",
                             param="labels")
    labels_need_text = ErrorSpec(400, INVALID_REQUEST, "labels are text: the query and items must be text too (with "
                                 "token IDs, give each label's token IDs in label_token_ids)", param="labels")
    empty_label = ErrorSpec(400, INVALID_VALUE, "{label} has no token: a label needs at least one")
    label_too_long = ErrorSpec(400, INVALID_VALUE, "{label} has {count} tokens, more than the limit of {limit} "
                               "(SCOREFN_MAX_LABEL_TOKENS)")
    invalid_label_normalization = ErrorSpec(400, INVALID_VALUE, "label_normalization must be one of {choices}, got "
                                            "{value!r}", param="label_normalization")
    invalid_label_normalization_type = _wrong_type("label_normalization")
    invalid_return_token_logprobs_type = _wrong_type("return_token_logprobs")
    # RFC-006: apply_softmax, item_first
    invalid_apply_softmax_type = _wrong_type("apply_softmax")
    invalid_item_first_type = _wrong_type("item_first")
    # RFC-006: model
    missing_model = _missing("model")  # reserved: model defaults to the served one
    model_not_found = ErrorSpec(400, MODEL, "Model '{model}' not found. Available models: {models}", param="model")
    not_a_choice = model_not_found.worded("Model '{model}' not found. Available {kind}s: {choices}{adapters}")
    # reserved: a not-yet-loaded model is server_not_ready
    model_not_loaded = ErrorSpec(500, MODEL, "The model is not loaded.")
    # Request shape (DESIGN.md additions and their siblings)
    invalid_model_type = _wrong_type("model")
    too_many_items = ErrorSpec(400, INVALID_REQUEST, TOO_MANY)
    too_many_labels = ErrorSpec(400, INVALID_REQUEST, TOO_MANY)
    empty_sequence = ErrorSpec(400, INVALID_VALUE, "{where}: {what} has no token.")
    context_length_exceeded = ErrorSpec(400, INVALID_REQUEST, TOO_LONG)
    prompt_too_long = context_length_exceeded.worded(TOO_LONG + " Set truncate_prompt_tokens to keep only its last "
                                                     "tokens.")  # /v1/classify
    pair_too_long = context_length_exceeded.worded(TOO_LONG + " Set max_tokens_per_doc to cut long documents.")
    too_many_tokens = ErrorSpec(400, INVALID_REQUEST, "The request's {what} have {count} tokens in total, more than "
                                "the limit of {limit}.")
    # cache_salt (every scoring endpoint): the prefix cache's isolation (runtime.requests.prefix_cache)
    invalid_cache_salt_type = _wrong_type("cache_salt")
    invalid_cache_salt = ErrorSpec(400, INVALID_VALUE, "cache_salt must be a non-empty string of at most {limit} "
                                   "characters; got {length}.", param="cache_salt")
    missing_text = _missing("text")  # /v1/tokenize
    invalid_text_type = _wrong_type("text")
    invalid_add_special_tokens_type = _wrong_type("add_special_tokens")
    # /v1/classify (token IDs in `input` use negative_token_id / token_id_exceeds_vocab, lengths the rows above)
    missing_input = _missing("input")
    empty_input = ErrorSpec(400, INVALID_VALUE, EMPTY_INPUTS, param="input")
    empty_input_element = empty_input.worded("{where} is empty{blank}; there is nothing to classify.")
    invalid_input_type = ErrorSpec(400, INVALID_REQUEST, INPUTS_KIND, param="input")
    input_beyond_int64 = invalid_input_type.worded(INT64_IDS)
    invalid_truncate_prompt_tokens_type = _wrong_type("truncate_prompt_tokens")
    invalid_truncate_prompt_tokens = ErrorSpec(400, INVALID_VALUE, "truncate_prompt_tokens must be -1 (the maximum "
                                               "sequence length, {limit}) or between 1 and {limit}; got {value}.",
                                               param="truncate_prompt_tokens")
    invalid_use_activation_type = _wrong_type("use_activation")
    invalid_user_type = _wrong_type("user")
    invalid_rid_type = _wrong_type("rid")
    invalid_priority_type = _wrong_type("priority")
    # the served model cannot answer this endpoint
    model_not_supported = ErrorSpec(400, MODEL, "The served model '{model}' is a sequence-classification model: it "
                                    "has no language-model head to score tokens with. Use POST /v1/classify.")
    adapter_classifies = model_not_supported.worded(ADAPTER_CLASSIFIES + ": use /v1/classify.", param="model")
    adapter_not_a_choice = model_not_supported.worded(ADAPTER_CLASSIFIES + ", not a {kind}: use /v1/classify.",
                                                      param="model")
    no_classifier = model_not_supported.worded("The served model '{model}' has no classifier: declare a "
                                               "prompt-verbalizer classifier in SCOREFN_CLASSIFIERS (see "
                                               "docs/api/classify.md).")
    no_reranker = model_not_supported.worded("The served model '{model}' has no reranker: declare one in "
                                             "SCOREFN_RERANKERS, or serve a one-label sequence-classification model "
                                             "(see docs/api/rerank.md).")
    # /v1/rerank (`query` uses RFC-006's query rows, lengths and counts the rows above)
    missing_documents = _missing("documents")
    empty_documents = ErrorSpec(400, INVALID_VALUE, "documents cannot be empty. At least one document is required.",
                                param="documents")
    invalid_documents_type = _wrong_type("documents")
    invalid_top_n_type = _wrong_type("top_n")
    invalid_top_n = ErrorSpec(400, INVALID_VALUE, POSITIVE, param="top_n")
    invalid_return_documents_type = _wrong_type("return_documents")
    invalid_max_tokens_per_doc_type = _wrong_type("max_tokens_per_doc")
    invalid_max_tokens_per_doc = ErrorSpec(400, INVALID_VALUE, POSITIVE, param="max_tokens_per_doc")
    # /v1/completions (token IDs in `prompt` use negative_token_id / token_id_exceeds_vocab, lengths and counts
    # the rows above)
    missing_prompt = _missing("prompt")
    empty_prompt = ErrorSpec(400, INVALID_VALUE, EMPTY_INPUTS, param="prompt")
    empty_prompt_element = empty_prompt.worded("{where} is empty; there is nothing to score.")
    invalid_prompt_type = ErrorSpec(400, INVALID_REQUEST, INPUTS_KIND, param="prompt")
    prompt_beyond_int64 = invalid_prompt_type.worded(INT64_IDS)
    # max_tokens absent or above 1
    generation_not_supported = ErrorSpec(400, INVALID_REQUEST, "max_tokens is {value}: this server scores prompts "
                                         "with one prefill and returns at most 1 token; it does not generate.",
                                         param="max_tokens")
    max_tokens_absent = generation_not_supported.worded("max_tokens is required and must be 0 or 1: this server "
                                                        "scores prompts with one prefill and does not generate "
                                                        "(OpenAI's default of 16 would).")
    invalid_max_tokens_type = _wrong_type("max_tokens")
    invalid_max_tokens = ErrorSpec(400, INVALID_VALUE, "max_tokens must be 0 or 1; got {value}.", param="max_tokens")
    invalid_echo_type = _wrong_type("echo")
    invalid_logprobs_type = _wrong_type("logprobs")
    invalid_logprobs = ErrorSpec(400, INVALID_VALUE, BETWEEN, param="logprobs")
    invalid_temperature_type = _wrong_type("temperature")
    invalid_temperature = ErrorSpec(400, INVALID_VALUE, BETWEEN, param="temperature")
    invalid_top_p_type = _wrong_type("top_p")
    invalid_top_p = ErrorSpec(400, INVALID_VALUE, "{param} must be {allowed}: nucleus truncation is not supported; "
                              "got {value}.", param="top_p")
    invalid_seed_type = _wrong_type("seed")
    invalid_stop_type = _wrong_type("stop")
    invalid_stop = ErrorSpec(400, INVALID_VALUE, TOO_MANY, param="stop")
    invalid_n_type = _wrong_type("n")
    invalid_n = ErrorSpec(400, INVALID_VALUE, ONE_CHOICE, param="n")
    invalid_best_of_type = _wrong_type("best_of")
    invalid_best_of = ErrorSpec(400, INVALID_VALUE, ONE_CHOICE, param="best_of")
    invalid_stream_type = _wrong_type("stream")
    stream_not_supported = ErrorSpec(400, INVALID_REQUEST, "stream must be false: a completion of at most one token is "
                                     "answered whole.", param="stream")
    invalid_suffix_type = _wrong_type("suffix")
    suffix_not_supported = ErrorSpec(400, INVALID_REQUEST, "suffix must be empty: inserting text needs the text after "
                                     "the completion, which a prefill of the prompt does not read.", param="suffix")
    invalid_presence_penalty_type = _wrong_type("presence_penalty")
    invalid_presence_penalty = ErrorSpec(400, INVALID_VALUE, BETWEEN, param="presence_penalty")
    invalid_frequency_penalty_type = _wrong_type("frequency_penalty")
    invalid_frequency_penalty = ErrorSpec(400, INVALID_VALUE, BETWEEN, param="frequency_penalty")
    # Transport (line_*: a line of a batch file, handler.batch)
    invalid_json = ErrorSpec(400, INVALID_REQUEST, "The request body is not valid JSON: {reason}")
    empty_body = invalid_json.worded("The request body is empty; expected a JSON object.")
    body_not_utf8 = invalid_json.worded("The request body is not valid UTF-8: {reason} at byte {at}.")
    body_too_deep = invalid_json.worded("The request body is not valid JSON: it is nested too deeply.")
    field_not_json = invalid_json.worded("{param} is not valid JSON: {reason}")
    line_not_json = invalid_json.worded("Line {line} is not valid JSON: {reason}")
    invalid_body_type = ErrorSpec(400, INVALID_REQUEST, "The request body must be a JSON object.")
    line_not_object = invalid_body_type.worded("Line {line} is not a JSON object.")
    # malformed HTTP the framework rejected
    invalid_request = ErrorSpec(400, INVALID_REQUEST, "The request is malformed: {detail}")
    bad_content_length = invalid_request.worded("The request is malformed: invalid Content-Length {value!r}.")
    body_unreadable = invalid_request.worded("The request body could not be read.")
    line_without_id = invalid_request.worded("Line {line} has no custom_id; give each line a non-empty string one.",
                                             param="custom_id")
    invalid_api_key = ErrorSpec(401, "authentication_error", "Incorrect or missing API key. Send it as "
                                "'Authorization: Bearer <key>'.")
    not_found = ErrorSpec(404, INVALID_REQUEST, "There is no endpoint at '{path}'. Endpoints: {endpoints}.")
    line_url_unknown = not_found.worded("Line {line}: url {url} is not one a batch can call; use one of {urls}.",
                                        param="url")
    method_not_allowed = ErrorSpec(405, INVALID_REQUEST, "Method {method} is not allowed on {path}; use {allowed}.")
    line_method_not_allowed = method_not_allowed.worded("Line {line}: method {method} is not allowed; use POST.",
                                                        param="method")
    request_too_large = ErrorSpec(413, INVALID_REQUEST, "The request body{size} is larger than the limit of {limit} "
                                  "bytes.")
    # Server state
    rate_limit_exceeded = ErrorSpec(429, "rate_limit_error", "The server is at capacity: {reason}. Please retry after "
                                    "{wait} second{plural}.", retry_after_s=1)
    internal_error = ErrorSpec(500, SERVER, INTERNAL_ERROR_MESSAGE)  # what went wrong goes to the log, not the client
    server_not_ready = ErrorSpec(503, SERVER, "The model is loading and compiling; retry shortly.", retry_after_s=5)
    model_loading = server_not_ready.worded("The model is loading; retry shortly.")
    draining = server_not_ready.worded("The server is shutting down; retry on another instance.")
    work_cancelled = server_not_ready.worded("The request was cancelled because the server is shutting down.")
    request_timeout = ErrorSpec(503, SERVER, "The request waited more than {timeout_s:g} s for the device and was "
                                "dropped without being scored. Please retry.", retry_after_s=1)


ERRORS = _Errors()

# What a client is told when the engine refuses or drops its work (runtime.interface says when each is raised). Any
# other exception, EngineFault included, is a 500: its details go to the log with the request id.
ENGINE_ERRORS: dict[type[BaseException], ErrorSpec] = {
    QueueFull: ERRORS.rate_limit_exceeded,
    DeadlineExceeded: ERRORS.request_timeout,
    ShuttingDown: ERRORS.work_cancelled,
    concurrent.futures.CancelledError: ERRORS.work_cancelled,
}


def engine_error(exc: BaseException) -> ErrorSpec | None:
    """The entry for an engine exception (of a class ENGINE_ERRORS names, or of a subclass), else None."""
    return next((ENGINE_ERRORS[cls] for cls in type(exc).__mro__ if cls in ENGINE_ERRORS), None)


class ApiError(Exception):
    """A request failure as the client gets it: an entry of ERRORS with its message filled in (ERRORS.<entry>(...)
    makes one)."""

    def __init__(self, spec: ErrorSpec, message: str, param: str | None = None, headers: Headers = ()) -> None:
        super().__init__(message)
        self.spec = spec
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Allow on a 405, WWW-Authenticate on a 401

    @property
    def code(self) -> str:
        return self.spec.code

    def __repr__(self) -> str:
        return f"ApiError({self.code!r}, {self.message!r}, param={self.param!r})"
