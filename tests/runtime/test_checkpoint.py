"""Checkpoint folders: config parsing for Llama/Mistral/Qwen2, safetensors discovery, and the
errors a user sees for a folder the runtime cannot load (raised before any weight is read)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvtune.runtime import LLM
from kvtune.runtime.checkpoint import RopeScaling, open_checkpoint, parse_config
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.model_source import resolve_model
from tests.runtime.conftest import save_word_tokenizer

SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def save_model(folder: Path, config, **save_kwargs) -> Path:
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, **save_kwargs)
    return folder


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {**LlamaConfig(**SMALL).to_dict(), "architectures": ["LlamaForCausalLM"], **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_llama_config_with_llama3_rope(tmp_path):
    folder = save_model(tmp_path, LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE))
    checkpoint = open_checkpoint(folder)
    config = checkpoint.config
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 2, 32)
    assert (config.num_attention_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert not (config.qkv_bias or config.o_bias or config.tie_word_embeddings)
    assert checkpoint.weight_files == (folder / "model.safetensors",)


def test_qwen2_has_qkv_bias_and_mistral_notes_its_window(tmp_path):
    qwen = open_checkpoint(save_model(tmp_path / "qwen", Qwen2Config(**SMALL))).config
    assert (qwen.qkv_bias, qwen.o_bias, qwen.sliding_window) == (True, False, None)
    mistral = open_checkpoint(
        save_model(tmp_path / "mistral", MistralConfig(**SMALL, sliding_window=4096))
    ).config
    assert (mistral.model_type, mistral.qkv_bias, mistral.sliding_window) == (
        "mistral",
        False,
        4096,
    )


def test_hub_style_rope_keys_read_like_transformers_5_ones():
    """Most Hub configs predate `rope_parameters`: rope_theta + rope_scaling with `type`."""
    legacy = {
        **LlamaConfig(**SMALL).to_dict(),
        "rope_parameters": None,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    config = parse_config(legacy)
    assert (config.rope_theta, config.rope_scaling.kind, config.rope_scaling.factor) == (
        500000.0,
        "linear",
        2.0,
    )


def test_sharded_checkpoint_reads_every_shard_of_its_index(tmp_path):
    folder = save_model(tmp_path, LlamaConfig(**SMALL), max_shard_size="20KB")
    checkpoint = open_checkpoint(folder)
    assert len(checkpoint.weight_files) > 1
    names = dict(checkpoint.tensors(torch.bfloat16))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(names) == set(index["weight_map"])
    assert {tensor.dtype for tensor in names.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model.model_type"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "model.architectures"),
        ({"hidden_act": "gelu"}, "model.hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "model.rope_scaling"),
        ({"rms_norm_eps": None}, "model.config"),
    ],
)
def test_unsupported_config_is_refused_before_weights(tmp_path, changes, field):
    folder = write_config(tmp_path, **changes)
    (folder / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ConfigError) as error:
        open_checkpoint(folder)
    assert error.value.field == field


def test_missing_folder_config_or_weights(tmp_path):
    for folder, allowed in [
        (tmp_path / "absent", "an existing local folder"),
        (tmp_path, "config.json"),
        (write_config(tmp_path / "no-weights"), "*.safetensors"),
    ]:
        with pytest.raises(ConfigError, match="model.path=") as error:
            open_checkpoint(folder)
        assert allowed in error.value.allowed


def test_pickle_weights_are_refused_not_loaded(tmp_path):
    """A pytorch_model.bin can run code when unpickled: the loader must not even open it."""
    folder = write_config(tmp_path)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    with pytest.raises(ConfigError, match=r"\*\.safetensors"):
        open_checkpoint(folder)


def test_index_naming_a_missing_shard(tmp_path):
    folder = save_model(tmp_path, LlamaConfig(**SMALL), max_shard_size="20KB")
    next(folder.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ConfigError, match="names missing"):
        open_checkpoint(folder)


def test_resolve_model_accepts_a_complete_folder_and_names_model_otherwise(tmp_path):
    folder = save_model(tmp_path / "tiny", LlamaConfig(**SMALL))
    with pytest.raises(ConfigError, match="tokenizer.json"):
        resolve_model(folder)
    (folder / "tokenizer.json").write_text("{}")
    assert resolve_model(str(folder)) == folder
    with pytest.raises(ConfigError) as error:
        resolve_model("llama-9000")
    assert error.value.field == "model"
    assert "smollm2-135m" in error.value.allowed


def test_a_context_beyond_the_models_positions_is_refused_before_weights_are_read(tmp_path):
    config = LlamaConfig(**SMALL, head_dim=32, max_position_embeddings=128)  # group_size 32
    folder = save_model(tmp_path / "tiny", config)
    save_word_tokenizer(folder, SMALL["vocab_size"])
    (folder / "model.safetensors").write_bytes(b"unreadable: reading the weights fails")
    with pytest.raises(ConfigError) as error:
        LLM(str(folder), max_model_len=129)
    assert error.value.field == "max_model_len" and "(128 tokens)" in error.value.allowed
    with pytest.raises(Exception) as loading:  # within the limit, the weights are read
        LLM(str(folder), max_model_len=128)
    assert not isinstance(loading.value, ConfigError)
