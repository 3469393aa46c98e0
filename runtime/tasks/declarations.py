"""What runtime.tasks.classifiers and runtime.tasks.rerankers declare alike: TOML files of named [[tables]], a template that
may go through the model's chat template, and verbalizer words that must be one token each.

Every helper raises the caller's error class (ClassifierError, RerankerError) with a message that names the
file, the declaration and the key at fault. Pure Python: the handler imports what builds on it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable

CHAT_KEYS = {"chat", "assistant_prefix"}


def read(path: str, setting: str, builtin: str, kind: str, parse: Callable[[str, str], Any], error: type) -> Any:
    """The declarations in the TOML file at `path` (the setting's value); empty: the built-in TOML."""
    if not path:
        return parse(builtin, f"built-in {kind}s")
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{setting}={path}: cannot read the file: {exc}") from None
    return parse(text, str(file))


def parse_tables(text: str, source: str, kind: str, keys: set[str], error: type,
                 spec: Callable[[dict, str, str], Any]) -> tuple[Any, ...]:
    """Each [[kind]] table of a TOML document (only `keys`, a `name` among them) as `spec(table, name, where)`,
    names unique."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{source}: invalid TOML: {exc}") from None
    extra = set(document) - {kind}
    if extra:
        raise error(f"{source}: unknown top-level keys {sorted(extra)}; declare [[{kind}]] tables")
    tables = document.get(kind)
    if not isinstance(tables, list) or not tables:
        raise error(f"{source}: declares no {kind}; add at least one [[{kind}]] table")
    specs = [spec(table, *_named(table, source, index, kind, keys, error)) for index, table in enumerate(tables)]
    names = [s.name for s in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise error(f"{source}: {kind} names must be unique; repeated: {duplicates}")
    return tuple(specs)


def _named(table: Any, source: str, index: int, kind: str, keys: set[str], error: type) -> tuple[str, str]:
    where = f"{source}: {kind} #{index + 1}"
    if not isinstance(table, dict):
        raise error(f"{where}: expected a [[{kind}]] table")
    unknown = set(table) - keys
    if unknown:
        raise error(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(keys)})")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise error(f"{where}: `name` must be a non-empty string")
    return name, f"{source}: {kind} '{name}'"


def chat_options(table: dict, where: str, error: type) -> tuple[bool, str]:
    """`chat` (render the template as the user's message in the model's chat template) and `assistant_prefix`."""
    chat = table.get("chat", False)
    prefix = table.get("assistant_prefix", "")
    if not isinstance(chat, bool):
        raise error(f"{where}: `chat` must be true or false")
    if not isinstance(prefix, str):
        raise error(f"{where}: `assistant_prefix` must be a string")
    if prefix and not chat:
        raise error(f"{where}: `assistant_prefix` needs `chat = true` (otherwise end the template with it)")
    return chat, prefix


def render(template: str, chat: bool, prefix: str, tokenizer: Any, where: str, error: type) -> str:
    """The template as the model reads it: through its chat template (then the assistant prefix) when `chat`."""
    if not chat:
        return template
    if not getattr(tokenizer, "chat_template", None):
        raise error(f"{where}: `chat = true`, but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": template}], tokenize=False,
                                         add_generation_prompt=True) + prefix


def verbalizer_tokens(word: str, tokenizer: Any, vocab_size: int, max_tokens: int, what: str,
                      error: type) -> int | tuple[int, ...]:
    """A verbalizer `word`'s tokens: its one token ID (the single-token path), or the tuple of its tokens (scored as
    the sum of their log-probabilities, runtime.requests.jobs.label_rows); `what` names it in messages ("classifier
    'x': label 'y': verbalizer")."""
    ids = list(tokenizer.encode(word, add_special_tokens=False))
    if not ids or len(ids) > max_tokens:
        pieces = tokenizer.convert_ids_to_tokens(ids) if ids else []
        raise error(f"{what} {word!r} is {len(ids)} tokens {ids} {pieces}, not 1 to SCOREFN_MAX_LABEL_TOKENS="
                    f"{max_tokens}; pick a shorter word (check with POST /v1/tokenize; mind the leading space)")
    beyond = [token for token in ids if token >= vocab_size]
    if beyond:
        raise error(f"{what} {word!r} is token {beyond[0]}, beyond the model's vocabulary of {vocab_size}")
    return ids[0] if len(ids) == 1 else tuple(ids)
