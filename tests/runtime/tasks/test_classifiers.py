"""Prompt-verbalizer classifier declarations: parsing, checks against the tokenizer, and a bad one failing start-up."""

from __future__ import annotations

import logging

import pytest

from runtime.tasks.classifiers import (BUILTIN_TOML, ClassifierError, build_classifiers, load_specs, parse_classifiers,
                                       resolve)
from runtime.model.config import config_from_hf

POSITIVE, NEGATIVE = 2731, 3524  # SmolLM2's " positive", " negative"

GOOD = '''
[[classifier]]
name = "topic"
template = "Text: {input}\\nTopic:"
labels = { sports = " sports", politics = " politics", science = " science" }

[[classifier]]
name = "polite"
template = "Is this polite? {input}"
chat = true
assistant_prefix = "Answer:"
labels = { yes = " yes", no = " no" }
'''
TOO_LONG = " grumpily" * 5  # more tokens than SCOREFN_MAX_LABEL_TOKENS (8)


def _toml(**fields: str) -> str:
    values = {"name": '"c"', "template": '"x {input}"', "labels": '{ a = " yes", b = " no" }', **fields}
    return "[[classifier]]\n" + "".join(f"{key} = {value}\n" for key, value in values.items() if value)


def test_parse_keeps_declaration_and_label_order():
    topic, polite = parse_classifiers(GOOD, "test.toml")
    assert topic.name == "topic" and topic.labels == ("sports", "politics", "science")
    assert topic.words == (" sports", " politics", " science") and not topic.chat
    assert polite.chat and polite.assistant_prefix == "Answer:"
    (builtin,) = parse_classifiers(BUILTIN_TOML, "built-in")
    assert builtin.name == "sentiment" and builtin.labels == ("positive", "negative")


@pytest.mark.parametrize("text, message", [
    ("[[classifier]\n", "invalid TOML"),
    ("", "declares no classifier"),
    ("title = 'x'\n", "unknown top-level keys"),
    (_toml(labels='{ a = " yes" }'), "at least two"),
    (_toml(labels='[" yes", " no"]'), "at least two"),
    (_toml(labels='{ a = " yes", b = 3 }'), "label 'b': the verbalizer word must be a non-empty string"),
    (_toml(template='"no placeholder"'), "exactly once"),
    (_toml(template='"{input} and {input}"'), "exactly once"),
    (_toml(name='""'), "`name` must be a non-empty string"),
    (_toml(chat='"yes"'), "`chat` must be true or false"),
    (_toml(assistant_prefix='"A:"'), "needs `chat = true`"),
    (_toml(lables='{ a = " yes" }'), "unknown keys ['lables']"),
    (_toml() + _toml(), "repeated: ['c']"),
])
def test_malformed_declarations_are_explained(text, message):
    with pytest.raises(ClassifierError, match="^my.toml: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        parse_classifiers(text, "my.toml")


def test_load_specs(tmp_path):
    assert load_specs("")[0].name == "sentiment"
    path = tmp_path / "classifiers.toml"
    path.write_text(GOOD)
    assert [spec.name for spec in load_specs(str(path))] == ["topic", "polite"]
    with pytest.raises(ClassifierError, match="SCOREFN_CLASSIFIERS=.*nowhere.toml: cannot read"):
        load_specs(str(tmp_path / "nowhere.toml"))


# ---- against the embedded model's tokenizer --------------------------------------------------------------


def test_builtin_sentiment_resolves_to_single_tokens(tokenizer):
    (spec,) = load_specs("")
    classifier = resolve(spec, tokenizer, 49152, 16, 8)
    assert classifier.label_ids == (POSITIVE, NEGATIVE) and classifier.activation == "softmax"
    assert classifier.prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                                 "Face<|im_end|>\n<|im_start|>user\nClassify the sentiment of this text as positive "
                                 "or negative.\nText: {input}<|im_end|>\n<|im_start|>assistant\nSentiment:")
    assert not classifier.add_special_tokens  # the chat template wrote the special tokens
    text = classifier.render("Great!")
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS anyway
    before, after = text.split("Great!")
    assert list(classifier.prefix_ids) == tokenizer.encode(before) and list(classifier.suffix_ids) == tokenizer.encode(
        after)


def test_multi_token_verbalizers_resolve_to_their_tokens_and_too_long_ones_fail_naming_everything(tokenizer):
    (spec,) = parse_classifiers(_toml(name='"mood"', labels='{ happy = " happy", grumpy = " grumpily" }'), "m.toml")
    ids = tokenizer.encode(" grumpily", add_special_tokens=False)
    assert len(ids) > 1
    classifier = resolve(spec, tokenizer, 49152, 16, 8)
    assert classifier.label_ids == (tokenizer.encode(" happy", add_special_tokens=False)[0], tuple(ids))
    with pytest.raises(ClassifierError) as caught:
        resolve(spec, tokenizer, 49152, 16, len(ids) - 1)
    message = str(caught.value)
    assert "classifier 'mood'" in message and "label 'grumpy'" in message and "' grumpily'" in message
    assert str(ids) in message and f"{len(ids)} tokens" in message and f"MAX_LABEL_TOKENS={len(ids) - 1}" in message
    assert all(piece in message for piece in tokenizer.convert_ids_to_tokens(ids))


def test_other_resolution_errors(tokenizer):
    (same,) = parse_classifiers(_toml(labels='{ a = " yes", b = " yes" }'), "t")
    with pytest.raises(ClassifierError, match="labels 'a' and 'b' have the same verbalizer token"):
        resolve(same, tokenizer, 49152, 16, 8)
    (spec,) = parse_classifiers(_toml(), "t")
    with pytest.raises(ClassifierError, match="2 labels, more than SCOREFN_MAX_LABELS=1"):
        resolve(spec, tokenizer, 49152, 1, 8)
    with pytest.raises(ClassifierError, match="beyond the model's vocabulary of 100"):
        resolve(spec, tokenizer, 100, 16, 8)
    (chat,) = parse_classifiers(_toml(chat="true"), "t")

    class NoChatTemplate:
        chat_template = None

    with pytest.raises(ClassifierError, match="has no chat template"):
        resolve(chat, NoChatTemplate(), 49152, 16, 8)


def test_plain_template_keeps_the_tokenizer_defaults(tokenizer):
    topic, _ = parse_classifiers(GOOD, "t")
    classifier = resolve(topic, tokenizer, 49152, 16, 8)
    assert classifier.prompt == "Text: {input}\nTopic:" and classifier.add_special_tokens
    assert len(classifier.label_ids) == 3


def _causal_config():
    return config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
                           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4})


def test_build_for_a_causal_lm(tokenizer, tmp_path, caplog):
    cfg = _causal_config()
    (builtin,) = build_classifiers("", cfg, "m", tokenizer, 16, 8)
    assert builtin.name == "sentiment"
    path = tmp_path / "c.toml"
    path.write_text(_toml(labels=f'{{ a = " yes", b = "{TOO_LONG}" }}'))
    with pytest.raises(ClassifierError, match="label 'b'"):  # a declared classifier that does not fit: start fails
        build_classifiers(str(path), cfg, "m", tokenizer, 16, 8)

    class OtherTokenizer:  # a model whose tokenizer splits the built-in verbalizers
        chat_template = "{{ messages[0]['content'] }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[0]["content"]

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def convert_ids_to_tokens(self, ids):
            return [chr(i) for i in ids]

    with caplog.at_level(logging.WARNING, logger="scorefn.runtime"):
        assert build_classifiers("", cfg, "m", OtherTokenizer(), 16, 1) == ()  # the built-in one is dropped, loudly
    assert "built-in classifier dropped" in caplog.text


def test_build_for_a_classification_head():
    raw = {"architectures": ["Qwen2ForSequenceClassification"], "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_labels": 3,
           "id2label": {"0": "neg", "2": "pos"}}
    (head,) = build_classifiers("", config_from_hf(raw), "my-cls", None, 16, 8)
    assert head.name == "my-cls" and head.labels == ("neg", "LABEL_1", "pos") and head.label_ids == (0, 1, 2)
    assert head.activation == "softmax" and not head.is_verbalizer and head.render("x") == "x"
    (one,) = build_classifiers("", config_from_hf({**raw, "num_labels": 1, "id2label": {}}), "r", None, 16, 8)
    assert one.activation == "sigmoid" and one.labels == ("LABEL_0",)
    multi = config_from_hf({**raw, "problem_type": "multi_label_classification"})
    assert build_classifiers("", multi, "m", None, 16, 8)[0].activation == "sigmoid"
    with pytest.raises(ClassifierError, match="need a causal language model.*Qwen2ForSequenceClassification"):
        build_classifiers("c.toml", config_from_hf(raw), "m", None, 16, 8)
    with pytest.raises(ClassifierError, match="3 labels, more than SCOREFN_MAX_LABELS=2"):
        build_classifiers("", config_from_hf(raw), "m", None, 2, 8)


@pytest.mark.slow
def test_bad_classifier_fails_warm_up_loudly(cache_dir, tmp_path, caplog):
    """The engine checks classifiers right after loading the tokenizer, before compiling: /ready stays 503."""
    from handler.core import ScoringCore
    from handler.lifecycle import warm_up
    from runtime.engine import Engine
    from runtime.settings import load_settings

    path = tmp_path / "classifiers.toml"
    path.write_text(_toml(name='"mood"', labels=f'{{ happy = " happy", grumpy = "{TOO_LONG}" }}'))
    settings = load_settings(environ={}, cache_dir=str(cache_dir), compile_cache_dir=str(tmp_path / "xla"),
                             classifiers=str(path), length_buckets=(16,), batch_buckets=(1,))
    core = ScoringCore(settings, Engine(settings))
    with caplog.at_level(logging.ERROR, logger="scorefn.handler"):
        warm_up(core)
    assert not core.ready and core.engine.stats()["compiles"] == 0
    (record,) = [r for r in caplog.records if "engine start failed" in r.getMessage()]
    assert f"classifier 'mood': label 'grumpy': verbalizer {TOO_LONG!r}" in str(record.exc_info[1])
