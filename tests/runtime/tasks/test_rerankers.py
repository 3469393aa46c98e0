"""Reranker declarations: parsing, checks against the tokenizer, document cutting, and a bad one failing start-up."""

from __future__ import annotations

import logging

import pytest

from runtime.model.config import config_from_hf
from runtime.tasks.rerankers import (BUILTIN_TOML, HEAD_TEMPLATE, RerankerError, build_rerankers, document_cutter,
                                     load_specs, parse_rerankers, resolve)

YES, NO = 9230, 2838  # SmolLM2's " Yes", " No"

GOOD = '''
[[reranker]]
name = "plain"
template = "Query: {query}\\nDocument: {document}\\nRelevant:"
yes = " yes"
no = " no"

[[reranker]]
name = "chatty"
template = "Is this relevant to {query}? {document}"
chat = true
assistant_prefix = "Answer:"
yes = " yes"
no = " no"
'''
TOO_LONG = " grumpily" * 5  # more tokens than SCOREFN_MAX_LABEL_TOKENS (8)


def _toml(**fields: str) -> str:
    values = {"name": '"r"', "template": '"{query} / {document}"', "yes": '" yes"', "no": '" no"', **fields}
    return "[[reranker]]\n" + "".join(f"{key} = {value}\n" for key, value in values.items() if value)


def _causal_config(vocab_size: int = 49152):
    return config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": 64,
                           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4})


def _head_config(num_labels: int = 1):
    return config_from_hf({"architectures": ["Qwen3ForSequenceClassification"], "vocab_size": 49152,
                           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                           "num_attention_heads": 4, "num_labels": num_labels})


def test_parse_keeps_the_declarations():
    plain, chatty = parse_rerankers(GOOD, "test.toml")
    assert (plain.name, plain.yes, plain.no, plain.chat) == ("plain", " yes", " no", False)
    assert chatty.chat and chatty.assistant_prefix == "Answer:"
    (builtin,) = parse_rerankers(BUILTIN_TOML, "built-in")
    assert builtin.name == "relevance" and builtin.template.index("{query}") < builtin.template.index("{document}")
    (head,) = parse_rerankers(_toml(yes="", no=""), "t")
    assert head.yes == head.no == ""


@pytest.mark.parametrize("text, message", [
    ("[[reranker]\n", "invalid TOML"),
    ("", "declares no reranker"),
    ("title = 'x'\n", "unknown top-level keys"),
    (_toml(template='"{query} only"'), "{query} once and {document} once"),
    (_toml(template='"{query} {document} {document}"'), "{query} once and {document} once"),
    (_toml(template='"{document} then {query}"'), "{query} must come before {document}"),
    (_toml(name='""'), "`name` must be a non-empty string"),
    (_toml(yes='""'), "`yes` must be a non-empty string"),
    (_toml(no="3"), "`no` must be a non-empty string"),
    (_toml(no=""), "declare both `yes` and `no`"),
    (_toml(chat='"yes"'), "`chat` must be true or false"),
    (_toml(assistant_prefix='"A:"'), "needs `chat = true`"),
    (_toml(label='" yes"'), "unknown keys ['label']"),
    (_toml() + _toml(), "repeated: ['r']"),
])
def test_malformed_declarations_are_explained(text, message):
    escaped = "".join("\\" + c if c in "[](){}" else c for c in message)
    with pytest.raises(RerankerError, match="^my.toml: .*" + escaped):
        parse_rerankers(text, "my.toml")


def test_load_specs(tmp_path):
    assert load_specs("")[0].name == "relevance"
    path = tmp_path / "rerankers.toml"
    path.write_text(GOOD)
    assert [spec.name for spec in load_specs(str(path))] == ["plain", "chatty"]
    with pytest.raises(RerankerError, match="SCOREFN_RERANKERS=.*nowhere.toml: cannot read"):
        load_specs(str(tmp_path / "nowhere.toml"))


# ---- against the embedded model's tokenizer --------------------------------------------------------------


def test_builtin_relevance_resolves_to_single_tokens(tokenizer):
    (spec,) = load_specs("")
    reranker = resolve(spec, tokenizer, _causal_config(), 16, 8)
    assert reranker.label_ids == (YES, NO) and reranker.is_verbalizer and reranker.words == (" Yes", " No")
    assert reranker.prompt.startswith("<|im_start|>system\n") and reranker.prompt.endswith(
        "<|im_start|>assistant\n" + spec.assistant_prefix)
    assert not reranker.add_special_tokens  # the chat template wrote the special tokens
    text = reranker.render("What is {document}?", "Paris {query}.")  # placeholders in the texts stay text
    assert "What is {document}?" in text and "Paris {query}." in text
    assert text.index("What is") < text.index("Paris")


def test_bad_words_fail_naming_everything(tokenizer):
    (spec,) = parse_rerankers(_toml(name='"grumpy"', yes='" grumpily"'), "t")
    ids = tokenizer.encode(" grumpily", add_special_tokens=False)
    assert len(ids) > 1
    assert resolve(spec, tokenizer, _causal_config(), 16, 8).label_ids[0] == tuple(ids)  # a word of several tokens
    with pytest.raises(RerankerError) as caught:
        resolve(spec, tokenizer, _causal_config(), 16, len(ids) - 1)
    message = str(caught.value)
    assert "reranker 'grumpy'" in message and "`yes` word ' grumpily'" in message and str(ids) in message
    assert all(piece in message for piece in tokenizer.convert_ids_to_tokens(ids))
    (same,) = parse_rerankers(_toml(no='" yes"'), "t")
    with pytest.raises(RerankerError, match="are the same token"):
        resolve(same, tokenizer, _causal_config(), 16, 8)
    (spec,) = parse_rerankers(_toml(), "t")
    with pytest.raises(RerankerError, match="reads 2 tokens, more than SCOREFN_MAX_LABELS=1"):
        resolve(spec, tokenizer, _causal_config(), 1, 8)
    with pytest.raises(RerankerError, match="beyond the model's vocabulary of 100"):
        resolve(spec, tokenizer, _causal_config(100), 16, 8)

    class NoChatTemplate:
        chat_template = None

    (chat,) = parse_rerankers(_toml(chat="true"), "t")
    with pytest.raises(RerankerError, match="has no chat template"):
        resolve(chat, NoChatTemplate(), _causal_config(), 16, 8)


def test_words_must_match_the_kind_of_model(tokenizer):
    (verbalizer,) = parse_rerankers(_toml(), "t")
    with pytest.raises(RerankerError, match="need a causal language model.*Qwen3ForSequenceClassification"):
        resolve(verbalizer, tokenizer, _head_config(), 16, 8)
    (head,) = parse_rerankers(_toml(yes="", no=""), "t")
    with pytest.raises(RerankerError, match="declare a `yes` and a `no` word"):
        resolve(head, tokenizer, _causal_config(), 16, 8)
    reranker = resolve(head, tokenizer, _head_config(), 16, 8)
    assert reranker.label_ids == (0,) and not reranker.is_verbalizer and reranker.add_special_tokens


def test_build_for_a_causal_lm(tokenizer, tmp_path, caplog):
    cfg = _causal_config()
    (builtin,) = build_rerankers("", cfg, "m", tokenizer, 16, 8, ("sentiment",))
    assert builtin.name == "relevance"
    path = tmp_path / "r.toml"
    path.write_text(_toml(no=f'"{TOO_LONG}"'))
    with pytest.raises(RerankerError, match="`no` word"):  # a declared reranker that does not fit: start fails
        build_rerankers(str(path), cfg, "m", tokenizer, 16, 8)
    path.write_text(_toml(name='"sentiment"'))
    with pytest.raises(RerankerError, match=r"\['sentiment'\] are already model ids"):
        build_rerankers(str(path), cfg, "m", tokenizer, 16, 8, ("sentiment",))
    path.write_text(_toml(name='"m"'))
    with pytest.raises(RerankerError, match=r"\['m'\] are already model ids"):
        build_rerankers(str(path), cfg, "m", tokenizer, 16, 8)

    class OtherTokenizer:  # a model whose tokenizer splits the built-in words
        chat_template = "{{ messages[0]['content'] }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def convert_ids_to_tokens(self, ids):
            return [chr(i) for i in ids]

    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        assert build_rerankers("", cfg, "m", OtherTokenizer(), 16, 1) == ()  # words of 3-4 tokens: dropped, loudly
        assert build_rerankers("", cfg, "m", tokenizer, 16, 8, ("relevance",)) == ()  # its name is a classifier's
    assert caplog.text.count("built-in reranker dropped") == 2


def test_build_for_a_classification_model(tokenizer, tmp_path):
    (own,) = build_rerankers("", _head_config(), "my-reranker", tokenizer, 16, 8, ("my-reranker",))
    assert own.name == "my-reranker" and own.prompt == HEAD_TEMPLATE and own.label_ids == (0,)
    assert own.render("q", "d") == "qd" and own.add_special_tokens  # vLLM's pair: the texts joined
    assert build_rerankers("", _head_config(3), "three-labels", tokenizer, 16, 8) == ()  # not a reranker
    path = tmp_path / "r.toml"
    path.write_text(_toml(name='"my-reranker"', template='"<Query>: {query}\\n<Document>: {document}"', yes="",
                          no=""))
    (declared,) = build_rerankers(str(path), _head_config(), "my-reranker", tokenizer, 16, 8, ("my-reranker",))
    assert declared.render("q", "d") == "<Query>: q\n<Document>: d" and declared.label_ids == (0,)
    with pytest.raises(RerankerError, match="reads a one-label head.*has 3 labels"):
        build_rerankers(str(path), _head_config(3), "m", tokenizer, 16, 8)
    path.write_text(_toml())
    with pytest.raises(RerankerError, match="need a causal language model"):
        build_rerankers(str(path), _head_config(), "m", tokenizer, 16, 8)


def test_documents_are_cut_after_their_nth_token(tokenizer):
    cut = document_cutter(tokenizer)
    text = "Paris is the capital and largest city of France, on the Seine."
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n in (1, 3, 7, len(ids) - 1):
        kept = cut(text, n)
        assert text.startswith(kept) and tokenizer.encode(kept, add_special_tokens=False) == ids[:n]
    assert cut(text, len(ids)) == text and cut(text, 10**9) == text and cut("", 3) == ""

    class SlowTokenizer:  # no offsets: the kept tokens are decoded
        is_fast = False

        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

        def decode(self, ids):
            return bytes(ids).decode()

    assert document_cutter(SlowTokenizer())("abcdef", 4) == "abcd"


@pytest.mark.slow
def test_bad_reranker_fails_warm_up_loudly(cache_dir, tmp_path, caplog):
    """The engine checks rerankers right after loading the tokenizer, before compiling: /ready stays 503."""
    from handler.core import ScoringCore
    from handler.lifecycle import warm_up
    from runtime.engine import Engine
    from runtime.settings import load_settings

    path = tmp_path / "rerankers.toml"
    path.write_text(_toml(name='"moody"', yes=f'"{TOO_LONG}"'))
    settings = load_settings(environ={}, cache_dir=str(cache_dir), compile_cache_dir=str(tmp_path / "xla"),
                             rerankers=str(path), length_buckets=(16,), batch_buckets=(1,))
    core = ScoringCore(settings, Engine(settings))
    with caplog.at_level(logging.ERROR, logger="scorefn.handler"):
        warm_up(core)
    assert not core.ready and core.engine.stats()["compiles"] == 0
    (record,) = [r for r in caplog.records if "engine start failed" in r.getMessage()]
    assert f"reranker 'moody': `yes` word {TOO_LONG!r} is" in str(record.exc_info[1])


def test_the_documented_declarations_parse_and_show_the_builtin():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "api" / "rerank.md").read_text()
    (block,) = [b.split("```")[0] for b in page.split("```toml\n")[1:] if "[[reranker]]" in b]
    builtin, qwen3 = parse_rerankers(block, "docs/api/rerank.md")
    assert builtin == parse_rerankers(BUILTIN_TOML, "built-in")[0]  # the docs show it as it ships
    assert qwen3.name == "qwen3-reranker" and (qwen3.yes, qwen3.no) == ("yes", "no") and not qwen3.chat
    assert qwen3.template.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert qwen3.template.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
