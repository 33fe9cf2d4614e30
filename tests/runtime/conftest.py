"""Model folders for runtime tests: tiny random Llama-family models and the embedded SmolLM2.

Tiny models are built from transformers' config classes with random weights drawn here from a
fixed seed (the same bits under every transformers release; no downloads) and
saved as safetensors with a word-level tokenizer, so they load through the same path as any
local Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kvtune.runtime.model_source import resolve_model

TINY_VOCAB = 96
INIT_STD = 0.02  # transformers' initializer_range: weights N(0, 0.02^2), biases 0, norms 1


def tiny_config(kind: str, head_dim: int = 32):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,  # kvtune checks group_size (default 32) divides head_dim
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if kind == "mistral":
        return MistralConfig(**common, rope_theta=1e6, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True}, rope_theta=1e6)
    raise ValueError(kind)


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def build_tiny_model(folder: Path, kind: str, seed: int = 0, head_dim: int = 32) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(kind, head_dim), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # our own draw: transformers' initialisation order changes by release
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
    model.save_pretrained(folder, safe_serialization=True)
    save_word_tokenizer(folder, TINY_VOCAB)
    return folder


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The embedded model, converted on first use into the kvtune cache ($KVTUNE_CACHE, else
    ~/.cache/kvtune) that every test and run on this machine shares: one conversion each."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session", params=["llama", "mistral", "qwen2"])
def tiny_model(request, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_head_dim_128(tmp_path_factory) -> Path:
    """A tiny Llama whose heads llama.cpp's rotation reaches (head_dim a multiple of 64; keys in
    blocks of 128, values in blocks of 64)."""
    return build_tiny_model(tmp_path_factory.mktemp("llama128"), "llama", head_dim=128)
