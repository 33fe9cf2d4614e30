"""runtime.tokenizer on the converted SmolLM2 folder, against transformers' AutoTokenizer reading
the same folder (its own chat-template renderer and special-token handling)."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Name the capital of France in one word."}],
    [
        {"role": "system", "content": "Answer with the 5-digit number only."},
        {"role": "user", "content": "The pass key is 48213.\n\nWhat is the pass key?"},
        {"role": "assistant", "content": "48213"},
        {"role": "user", "content": "Und jetzt auf Deutsch? 🤖"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(smollm2_folder):
    return Tokenizer.from_folder(smollm2_folder), AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers, messages, add_generation_prompt):
    ours, reference = tokenizers
    text = ours.apply_chat_template(messages, add_generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode_chat(messages, add_generation_prompt) == reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )


def test_generation_prompt_opens_the_assistant_turn(tokenizers):
    ours, _ = tokenizers
    text = ours.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system prompt
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_encode_decode_round_trip_and_special_tokens(tokenizers):
    ours, reference = tokenizers
    text = "Pass key 48213 — naïve café 日本 🤖\n\n  indented"
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == text
    marked = ours.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert marked[0] == ours.token_id("bos_token") == 1 and marked[-1] == 2
    assert ours.decode(marked) == "assistant\nParis"
    assert ours.eos_token_ids == (2,)
    assert ours.vocab_size == 49152 == len(reference)


def test_eos_ids_include_the_generation_config_ones(smollm2_folder, tmp_path):
    """Llama 3 style: generation ends on any of several ids, listed in generation_config.json."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == (2, 0)


def test_missing_tokenizer_or_template_is_a_config_error(smollm2_folder, tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    shutil.copy(smollm2_folder / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="chat template"):
        Tokenizer.from_folder(tmp_path).apply_chat_template(CONVERSATIONS[0])


def test_template_from_jinja_file_or_named_list(smollm2_folder, tmp_path):
    """transformers 5 saves chat_template.jinja; some configs hold a list of named templates."""
    shutil.copy(smollm2_folder / "tokenizer.json", tmp_path / "tokenizer.json")
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(messages) == "hi!"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    assert Tokenizer.from_folder(tmp_path).apply_chat_template(messages) == '"hi"'
