"""Qwen2.5-Coder-0.5B-Instruct, the embedded long-context model, against transformers reading
the same GGUF file itself (AutoModelForCausalLM / AutoTokenizer with gguf_file=...: its own
metadata parsing, dequantization and tokenizer building, independent of
kvtune/runtime/gguf_convert.py).

Checked: the preset conf/model/qwen2.5-coder-0.5b.yaml against the file's metadata; the
converted folder's config, weights, tokenizer and chat template; and kvtune's runtime (paged
fp16 cache, fp32 compute) against transformers' fp32 logits on a short chat prompt and on one
crossing many KV blocks. The first use on a machine joins and converts the model into the
kvtune cache (about 30 s on two CPU cores, 2.8 GB written); the slow tests load the
630M-parameter model twice in fp32: the module takes about 95 s with the model converted, about
3 min on an empty cache (a shared 2-core machine), and 6 GB of memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gguf import GGUFReader
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvtune.runtime import LLM
from kvtune.runtime.checkpoint import open_checkpoint
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.model_source import embedded_gguf, resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer
from tests.runtime.test_gguf_convert import CONVERSATIONS, TEXTS

NAME = "qwen2.5-coder-0.5b"
PRESET = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{NAME}.yaml"
GIB = 2**30
BF16_BYTES = 2  # the preset's dtype, as transformers' Hub checkpoint stores the model
CODE = "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"
# Relative error = ||ours - transformers|| / ||transformers|| over all logits of a prompt. The
# fp16 cache rounds every cached k and v to 11 significant bits: measured 5.7e-4 (39-token
# prompt) and 3.7e-4 (425 tokens), every position's argmax equal; with an fp32 (`auto`) cache
# the runtime gives transformers' logits bit for bit.
FP16_CACHE_TOLERANCE = 2e-3
LONG_PROMPT_REPEATS = 12  # 425 tokens: 27 blocks of 16


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return embedded_gguf(NAME)


@pytest.fixture(scope="module")
def qwen_folder() -> Path:
    return resolve_model(NAME)


@pytest.fixture(scope="module")
def metadata(gguf_file) -> dict:
    reader = GGUFReader(gguf_file)
    fields = {key: entry.contents() for key, entry in reader.fields.items() if "qwen2." in key}
    fields["parameters"] = sum(int(tensor.n_elements) for tensor in reader.tensors)
    return fields


def test_preset_fields_are_the_gguf_metadata(metadata):
    preset = yaml.safe_load(PRESET.read_text())
    heads = metadata["qwen2.attention.head_count"]
    assert preset == {
        "name": NAME,
        "path": None,
        "num_layers": metadata["qwen2.block_count"],
        "num_attention_heads": heads,
        "num_kv_heads": metadata["qwen2.attention.head_count_kv"],
        "head_dim": metadata["qwen2.embedding_length"] // heads,
        "kv_lora_rank": 0,
        "qk_rope_head_dim": 0,
        "weights_gib": round(metadata["parameters"] * BF16_BYTES / GIB, 4),
        "max_position_embeddings": metadata["qwen2.context_length"],
        "dtype": "bf16",
    }
    assert preset["max_position_embeddings"] == 32768


@pytest.mark.slow
def test_converted_config_is_transformers_reading_of_the_gguf(qwen_folder, gguf_file):
    reference = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = json.loads((qwen_folder / "config.json").read_text())
    assert ours["model_type"] == reference.model_type == "qwen2"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert ours[key] == getattr(reference, key), key
    assert ours["rope_theta"] == reference.rope_parameters["rope_theta"] == 1e6
    assert np.float32(ours["rms_norm_eps"]) == np.float32(reference.rms_norm_eps)
    config = open_checkpoint(qwen_folder).config
    assert config.qkv_bias and not config.o_bias and not config.tie_word_embeddings
    assert config.sliding_window is None  # attends to the whole context, as Qwen2.5 does


@pytest.mark.slow  # converts the model on a machine's first use
def test_a_context_beyond_32k_positions_is_refused_in_one_line(qwen_folder):
    with pytest.raises(ConfigError, match="max_position_embeddings \\(32768 tokens\\)") as error:
        LLM(NAME, policy=KVPolicy("fp16", "fp16"), max_model_len=32769)
    assert error.value.field == "max_model_len" and len(str(error.value).splitlines()) == 1


@pytest.fixture(scope="module")
def reference(gguf_file) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loading(qwen_folder, reference):
    expected = reference.state_dict()
    with safe_open(str(qwen_folder / "model.safetensors"), framework="pt") as ours:
        assert set(ours.keys()) == set(expected)  # q/k/v biases and an untied lm_head included
        for name in ours.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            assert torch.equal(ours.get_tensor(name), expected[name]), name


@pytest.mark.slow
def test_tokenizer_and_chat_template_match_transformers(qwen_folder, gguf_file):
    reference = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = Tokenizer.from_folder(qwen_folder)
    for text in [*TEXTS, CODE, "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|><tool_call>"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip), text
    assert ours.eos_token_ids == (reference.eos_token_id,)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(messages) == expected


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


@pytest.mark.slow
@torch.no_grad()
def test_runtime_logits_match_transformers_through_an_fp16_cache(qwen_folder, reference):
    llm = LLM(NAME, policy=KVPolicy("fp16", "fp16", block_size=16), dtype="fp32", max_model_len=512)
    short = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    long = [{"role": "user", "content": f"Explain this code.\n{CODE}\n" * LONG_PROMPT_REPEATS}]
    for messages in (short, long):
        ids = llm.tokenizer.encode_chat(messages)
        ours = llm.prompt_logits(ids)
        expected = reference(torch.tensor([ids])).logits[0]
        assert relative_error(ours, expected) < FP16_CACHE_TOLERANCE, len(ids)
        assert int(ours[-1].argmax()) == int(expected[-1].argmax())
    assert len(ids) > 16 * 16  # the long prompt spans more than 16 KV blocks
