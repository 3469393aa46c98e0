"""MkDocs hooks (mkdocs.yml `hooks:`): the tables that the code already holds are generated from it, never copied.

A page that holds a marker, on a line of its own, gets the table in its place when the site is built:

- `<!-- scorefn:settings -->`: every setting of `runtime/settings.py` (`SETTINGS`: its environment variable,
  default and help), in the table's order;
- `<!-- scorefn:errors -->`: every error code of `handler/errors.py` (`ERRORS`: HTTP status, error type, whether
  the answer carries `Retry-After`), in the table's order, with what it means from `ERROR_MEANINGS` below.

`ERRORS` has no column that says when a code is returned, so that text is kept here, one row per group of codes.
A code of `ERRORS` that no group names, or a group's code that `ERRORS` lacks, is a warning, and `mkdocs build
--strict` (`make docs`, tests/test_docs.py) fails on it: a new error code needs its line here.
"""

from __future__ import annotations

import html
import logging
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the tables are imported from the checkout, whichever mkdocs runs this
    sys.path.insert(0, str(REPO))

from handler.errors import ERRORS  # noqa: E402  (pure Python: no JAX, no Litestar)
from runtime.settings import SETTINGS  # noqa: E402  (pure Python)

log = logging.getLogger("mkdocs.hooks.scorefn")  # under "mkdocs": --strict counts its warnings

SETTINGS_MARKER = "<!-- scorefn:settings -->"
ERRORS_MARKER = "<!-- scorefn:errors -->"
# The default shown for the cache directory: SETTINGS holds the builder's own home directory.
SHOWN_DEFAULTS = {"cache_dir": "~/.cache/scorefn"}

# (codes, when): RFC-006's rows first, in its order, then the additions. Every code of handler/errors.py once.
ERROR_MEANINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("missing_query", "empty_query", "invalid_query_type"),
     "`query` absent, empty, or not a string / token list (`/v1/score`, `/v1/rerank`)"),
    (("missing_items", "empty_items", "invalid_items_type"), "`items` absent, `[]`, or of the wrong type"),
    (("mixed_input_types",), "text query with token items or the reverse"),
    (("missing_label_token_ids", "empty_label_token_ids", "invalid_label_token_ids_type", "invalid_token_id_type"),
     "labels absent, empty, not a list, or holding a non-integer"),
    (("negative_token_id",), "a negative label (or token in token mode)"),
    (("token_id_exceeds_vocab",), "an ID >= the vocabulary size (the message states both)"),
    (("conflicting_labels",), "both `label_token_ids` and `labels` given"),
    (("invalid_labels_type", "empty_labels"), "`labels` not a list of strings, or `[]`"),
    (("labels_need_text",), "`labels` (text) with a token-ID query and items"),
    (("empty_label", "label_too_long"),
     "a label of no token, or of more than `SCOREFN_MAX_LABEL_TOKENS` (the message names the label)"),
    (("invalid_label_normalization", "invalid_label_normalization_type"),
     "`label_normalization` not `sum`, `mean` or null"),
    (("invalid_return_token_logprobs_type",), "`return_token_logprobs` not a boolean"),
    (("invalid_apply_softmax_type", "invalid_item_first_type", "invalid_model_type"),
     "non-boolean flags, non-string model"),
    (("missing_model", "model_not_loaded"),
     "reserved: RFC-006 rows that cannot occur here (`model` is optional; the one served model is always loaded)"),
    (("model_not_found",),
     "`model` is not the served model (`/v1/classify`: not a classifier's id; `/v1/rerank`: not a reranker's id)"),
    (("too_many_items", "too_many_labels", "too_many_tokens"),
     "over `SCOREFN_MAX_ITEMS`, `SCOREFN_MAX_LABELS`, `SCOREFN_MAX_TOTAL_TOKENS`"),
    (("invalid_cache_salt_type", "invalid_cache_salt"),
     "`cache_salt` not a string, empty, or over 256 characters ([the prefix cache](how-it-works/prefix-cache.md))"),
    (("empty_sequence",), "an item whose full sequence has no token (nothing to predict from)"),
    (("context_length_exceeded",),
     "a sequence longer than the largest length bucket (never truncated; the message states limit and length)"),
    (("missing_text", "invalid_text_type", "invalid_add_special_tokens_type"), "`/v1/tokenize` body errors"),
    (("missing_input", "empty_input", "invalid_input_type"),
     "`/v1/classify`: `input` absent, empty (`\"\"`, `[]`, whitespace only, or an empty element), or of the wrong "
     "type (token IDs in it: `negative_token_id`, 422 `token_id_exceeds_vocab`)"),
    (("invalid_truncate_prompt_tokens_type", "invalid_truncate_prompt_tokens"),
     "`truncate_prompt_tokens` not an integer, or not `-1` / 1 to the largest length bucket"),
    (("invalid_use_activation_type", "invalid_user_type", "invalid_rid_type", "invalid_priority_type"),
     "`/v1/classify`: a non-boolean `use_activation`, a non-string `user` / `rid`, a non-integer `priority`"),
    (("model_not_supported",),
     "`/v1/score` or `/v1/completions` on a sequence-classification model, or `/v1/classify` / `/v1/rerank` with no "
     "classifier / reranker (e.g. the built-in one does not fit a custom model)"),
    (("missing_documents", "empty_documents", "invalid_documents_type"),
     "`/v1/rerank`: `documents` absent, `[]`, or not a list of strings / `{\"text\": string}` objects (`query` has "
     "the `missing_query`, `empty_query`, `invalid_query_type` rows above; too many documents `too_many_items`, a "
     "pair too long `context_length_exceeded`)"),
    (("invalid_top_n_type", "invalid_top_n"), "`top_n` not an integer, or below 1"),
    (("invalid_return_documents_type", "invalid_max_tokens_per_doc_type", "invalid_max_tokens_per_doc"),
     "a non-boolean `return_documents`; `max_tokens_per_doc` not an integer, or below 1"),
    (("missing_prompt", "empty_prompt", "invalid_prompt_type"),
     "`/v1/completions`: `prompt` absent, empty (or an empty element), or of the wrong type (token IDs: "
     "`negative_token_id`, 422 `token_id_exceeds_vocab`; too many prompts `too_many_items`, too long "
     "`context_length_exceeded`)"),
    (("generation_not_supported",),
     "`/v1/completions` with `max_tokens` absent or above 1: scorefn scores, it does not generate"),
    (("invalid_max_tokens_type", "invalid_max_tokens", "invalid_echo_type", "invalid_logprobs_type",
      "invalid_logprobs", "invalid_temperature_type", "invalid_temperature", "invalid_top_p_type", "invalid_top_p",
      "invalid_seed_type", "invalid_stop_type", "invalid_stop", "invalid_n_type", "invalid_n",
      "invalid_best_of_type", "invalid_best_of", "invalid_stream_type", "invalid_suffix_type",
      "invalid_presence_penalty_type", "invalid_presence_penalty", "invalid_frequency_penalty_type",
      "invalid_frequency_penalty"),
     "`/v1/completions`: a field of the wrong type, or out of its range ([the request's table](api/completions.md))"),
    (("stream_not_supported", "suffix_not_supported"),
     "`/v1/completions` with `stream: true`, or a non-empty `suffix`"),
    (("invalid_json", "invalid_body_type", "invalid_request"),
     "malformed JSON, a body that is not an object, malformed HTTP"),
    (("invalid_api_key",), "`SCOREFN_API_KEYS` is set and `Authorization: Bearer <key>` is missing or wrong"),
    (("not_found", "method_not_allowed"), "unknown path / wrong method"),
    (("request_too_large",), "body over `SCOREFN_MAX_BODY_BYTES`; the body is not read past the limit"),
    (("rate_limit_exceeded",),
     "a small request would not be answered within `SCOREFN_MAX_WAIT_S`, a request would not start before its "
     "deadline, the instance is overloaded and its backlog full, or `SCOREFN_MAX_QUEUE` requests wait; `Retry-After` "
     "says when the work ahead is predicted to have drained enough (whole seconds, at least 1)"),
    (("internal_error",), "anything unexpected (details only in the server log, with the request id)"),
    (("server_not_ready",), "warming up or draining"),
    (("request_timeout",), "the request waited longer than `SCOREFN_REQUEST_TIMEOUT_S`; its work was dropped"),
)


def _text(markdown: str) -> str:
    """`markdown` for a table cell: code spans kept as written, everything else shown literally (no emphasis, no
    raw HTML, no cell break)."""
    parts = re.split(r"(`[^`]*`)", markdown)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) >= 2:
            out.append(part.replace("|", "\\|"))
        else:
            out.append(re.sub(r"([\\*_\[\]|])", r"\\\1", html.escape(part, quote=False)))
    return "".join(out)


def settings_table() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for setting in SETTINGS:
        default = SHOWN_DEFAULTS.get(setting.name, setting.default)
        shown = f"`{default}`" if default else "(empty)"
        rows.append(f"| `{setting.env}` | {shown} | {_text(setting.help)} |")
    return "\n".join(rows)


def _per_code(values: list[str], sep: str) -> str:
    """One value when the group's codes share it, else one per code, in the codes' order."""
    return values[0] if len(set(values)) == 1 else sep.join(values)


def errors_table() -> str:
    meaning_of: dict[str, int] = {}
    for index, (codes, _) in enumerate(ERROR_MEANINGS):
        for code in codes:
            if code not in ERRORS:
                log.warning("docs/hooks.py: ERROR_MEANINGS names %r, which handler/errors.py's ERRORS lacks", code)
            elif code in meaning_of:
                log.warning("docs/hooks.py: ERROR_MEANINGS names %r twice", code)
            else:
                meaning_of[code] = index
    rows = ["| status | code | type | `Retry-After` | when |", "| --- | --- | --- | --- | --- |"]
    done: set[int] = set()
    for code in ERRORS:  # in handler/errors.py's order; a group's row where its first code comes
        if code not in meaning_of:
            log.warning("docs/hooks.py: error code %r (handler/errors.py) has no line in ERROR_MEANINGS", code)
            codes, when = (code,), "(not documented yet)"
        elif meaning_of[code] in done:
            continue
        else:
            done.add(meaning_of[code])
            codes, when = ERROR_MEANINGS[meaning_of[code]]
            codes = tuple(c for c in codes if c in ERRORS)
        specs = [ERRORS[c] for c in codes]
        status = _per_code([str(spec.status) for spec in specs], " / ")
        kinds = _per_code([f"`{spec.type}`" for spec in specs], ", ")
        retry = "yes" if any(spec.retry_after_s is not None for spec in specs) else ""
        rows.append(f"| {status} | {', '.join(f'`{c}`' for c in codes)} | {kinds} | {retry} | {when} |")
    return "\n".join(rows)


def _replace(markdown: str, marker: str, table) -> str:
    """The marker on a line of its own becomes the table (a marker quoted in a sentence stays as it is)."""
    pattern = re.compile(rf"^{re.escape(marker)}[ \t]*$", re.MULTILINE)
    return pattern.sub(lambda _: table(), markdown) if pattern.search(markdown) else markdown


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _replace(markdown, SETTINGS_MARKER, settings_table)
    return _replace(markdown, ERRORS_MARKER, errors_table)
