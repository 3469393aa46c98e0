"""The closed error taxonomy: every error code the API can return, mapped to HTTP in one table.

Bodies follow RFC-006 / OpenAI: `{"error": {"message", "type", "param", "code"}}`; `param` is null when no
single request field is at fault. Codes marked "reserved" are RFC-006 rows that DESIGN.md's decisions make
unreachable (`model` is optional; the one served model is always loaded) but keep in the contract.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str
    retry_after_s: int | None = None  # Retry-After on responses that invite a retry (unless the error sets its own)


# code -> (HTTP status, error type). RFC-006 rows first, in its order, then DESIGN.md's and this module's additions.
ERRORS: dict[str, ErrorSpec] = {
    # RFC-006: query
    "missing_query": ErrorSpec(400, "missing_parameter_error"),
    "empty_query": ErrorSpec(400, "invalid_value_error"),
    "invalid_query_type": ErrorSpec(400, "invalid_request_error"),
    # RFC-006: items
    "missing_items": ErrorSpec(400, "missing_parameter_error"),
    "empty_items": ErrorSpec(400, "invalid_value_error"),
    "invalid_items_type": ErrorSpec(400, "invalid_request_error"),
    "mixed_input_types": ErrorSpec(400, "invalid_request_error"),
    # RFC-006: label_token_ids (negative_token_id / token_id_exceeds_vocab also for token-mode query and items)
    "missing_label_token_ids": ErrorSpec(400, "missing_parameter_error"),
    "empty_label_token_ids": ErrorSpec(400, "invalid_value_error"),
    "negative_token_id": ErrorSpec(400, "invalid_value_error"),
    "token_id_exceeds_vocab": ErrorSpec(422, "invalid_value_error"),
    "invalid_label_token_ids_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_token_id_type": ErrorSpec(400, "invalid_request_error"),
    # /v1/score's labels of several tokens (label_token_ids' lists, or `labels` as text)
    "conflicting_labels": ErrorSpec(400, "invalid_request_error"),
    "invalid_labels_type": ErrorSpec(400, "invalid_request_error"),
    "empty_labels": ErrorSpec(400, "invalid_value_error"),
    "labels_need_text": ErrorSpec(400, "invalid_request_error"),
    "empty_label": ErrorSpec(400, "invalid_value_error"),
    "label_too_long": ErrorSpec(400, "invalid_value_error"),
    "invalid_label_normalization": ErrorSpec(400, "invalid_value_error"),
    "invalid_label_normalization_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_return_token_logprobs_type": ErrorSpec(400, "invalid_request_error"),
    # RFC-006: apply_softmax, item_first
    "invalid_apply_softmax_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_item_first_type": ErrorSpec(400, "invalid_request_error"),
    # RFC-006: model
    "missing_model": ErrorSpec(400, "missing_parameter_error"),  # reserved: model defaults to the served one
    "model_not_found": ErrorSpec(400, "model_error"),
    "model_not_loaded": ErrorSpec(500, "model_error"),  # reserved: a not-yet-loaded model is server_not_ready
    # Request shape (DESIGN.md additions and their siblings)
    "invalid_model_type": ErrorSpec(400, "invalid_request_error"),
    "too_many_items": ErrorSpec(400, "invalid_request_error"),
    "too_many_labels": ErrorSpec(400, "invalid_request_error"),
    "empty_sequence": ErrorSpec(400, "invalid_value_error"),
    "context_length_exceeded": ErrorSpec(400, "invalid_request_error"),
    "too_many_tokens": ErrorSpec(400, "invalid_request_error"),
    "missing_text": ErrorSpec(400, "missing_parameter_error"),  # /v1/tokenize
    "invalid_text_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_add_special_tokens_type": ErrorSpec(400, "invalid_request_error"),
    # /v1/classify (token IDs in `input` use negative_token_id / token_id_exceeds_vocab, lengths the rows above)
    "missing_input": ErrorSpec(400, "missing_parameter_error"),
    "empty_input": ErrorSpec(400, "invalid_value_error"),
    "invalid_input_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_truncate_prompt_tokens_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_truncate_prompt_tokens": ErrorSpec(400, "invalid_value_error"),
    "invalid_use_activation_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_user_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_rid_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_priority_type": ErrorSpec(400, "invalid_request_error"),
    "model_not_supported": ErrorSpec(400, "model_error"),  # the served model cannot answer this endpoint
    # /v1/rerank (`query` uses RFC-006's query rows, lengths and counts the rows above)
    "missing_documents": ErrorSpec(400, "missing_parameter_error"),
    "empty_documents": ErrorSpec(400, "invalid_value_error"),
    "invalid_documents_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_top_n_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_top_n": ErrorSpec(400, "invalid_value_error"),
    "invalid_return_documents_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_max_tokens_per_doc_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_max_tokens_per_doc": ErrorSpec(400, "invalid_value_error"),
    # /v1/completions (token IDs in `prompt` use negative_token_id / token_id_exceeds_vocab, lengths and counts
    # the rows above)
    "missing_prompt": ErrorSpec(400, "missing_parameter_error"),
    "empty_prompt": ErrorSpec(400, "invalid_value_error"),
    "invalid_prompt_type": ErrorSpec(400, "invalid_request_error"),
    "generation_not_supported": ErrorSpec(400, "invalid_request_error"),  # max_tokens absent or above 1
    "invalid_max_tokens_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_max_tokens": ErrorSpec(400, "invalid_value_error"),
    "invalid_echo_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_logprobs_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_logprobs": ErrorSpec(400, "invalid_value_error"),
    "invalid_temperature_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_temperature": ErrorSpec(400, "invalid_value_error"),
    "invalid_top_p_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_top_p": ErrorSpec(400, "invalid_value_error"),
    "invalid_seed_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_stop_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_stop": ErrorSpec(400, "invalid_value_error"),
    "invalid_n_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_n": ErrorSpec(400, "invalid_value_error"),
    "invalid_best_of_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_best_of": ErrorSpec(400, "invalid_value_error"),
    "invalid_stream_type": ErrorSpec(400, "invalid_request_error"),
    "stream_not_supported": ErrorSpec(400, "invalid_request_error"),
    "invalid_suffix_type": ErrorSpec(400, "invalid_request_error"),
    "suffix_not_supported": ErrorSpec(400, "invalid_request_error"),
    "invalid_presence_penalty_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_presence_penalty": ErrorSpec(400, "invalid_value_error"),
    "invalid_frequency_penalty_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_frequency_penalty": ErrorSpec(400, "invalid_value_error"),
    # Transport
    "invalid_json": ErrorSpec(400, "invalid_request_error"),
    "invalid_body_type": ErrorSpec(400, "invalid_request_error"),
    "invalid_request": ErrorSpec(400, "invalid_request_error"),  # malformed HTTP the framework rejected
    "invalid_api_key": ErrorSpec(401, "authentication_error"),
    "not_found": ErrorSpec(404, "invalid_request_error"),
    "method_not_allowed": ErrorSpec(405, "invalid_request_error"),
    "request_too_large": ErrorSpec(413, "invalid_request_error"),
    # Server state
    "rate_limit_exceeded": ErrorSpec(429, "rate_limit_error", retry_after_s=1),
    "internal_error": ErrorSpec(500, "server_error"),
    "server_not_ready": ErrorSpec(503, "server_error", retry_after_s=5),
    "request_timeout": ErrorSpec(503, "server_error", retry_after_s=1),
}

INTERNAL_ERROR_MESSAGE = "An internal error occurred. Please try again."


class ApiError(Exception):
    """A request failure with its client-facing message; `code` must be a key of ERRORS."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        if code not in ERRORS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers  # e.g. Allow on a 405, WWW-Authenticate on a 401

    @property
    def spec(self) -> ErrorSpec:
        return ERRORS[self.code]

    def __repr__(self) -> str:
        return f"ApiError({self.code!r}, {self.message!r}, param={self.param!r})"


def internal_error() -> ApiError:
    """The one 500: a fixed message; what went wrong goes to the log, never to the client."""
    return ApiError("internal_error", INTERNAL_ERROR_MESSAGE)
