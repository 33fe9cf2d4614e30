"""A local Hugging Face checkpoint folder: its decoder hyperparameters and its safetensors weights.

`open_checkpoint` reads config.json and lists the weight files without reading any weight, so a
wrong folder, an unsupported architecture or a pickle-only checkpoint is refused in milliseconds,
before gigabytes are loaded. Weights come only from safetensors: pickle files (`*.bin`, `*.pt`)
can run code when loaded and are never opened.

Both config spellings are read: transformers 5 writes `rope_parameters` and `dtype`, older
configs (most of the Hub) `rope_theta`, `rope_scaling` and `torch_dtype`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtune.runtime.errors import ConfigError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# model_type -> the causal-LM class its config names, for the decoders kvtune/runtime/model.py runs.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
)


@dataclass(frozen=True)
class RopeScaling:
    """Stretching of the rotary frequencies for contexts longer than pre-training.

    kind: "linear" divides every frequency by factor; "llama3" divides the low frequencies by
    factor, keeps the high ones and blends in between (Llama 3.1). The *_freq_factor and
    original_max_position_embeddings (tokens; the config's max_position_embeddings when absent)
    fields are used by "llama3" only.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama, Mistral, Qwen2).

    qkv_bias / o_bias: biases on the q, k, v and the output projections (Qwen2 has qkv only;
    Llama's attention_bias sets both). sliding_window (tokens) is recorded for Mistral/Qwen2
    but the runtime attends to the full context. dtype: the checkpoint's stored float type.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    dtype: str


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint folder: its config and the safetensors files holding its weights."""

    folder: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every stored weight, converted to dtype on the CPU, one at a time."""
        for path in self.weight_files:
            with safe_open(str(path), framework="pt", device="cpu") as weights:
                for name in weights.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, weights.get_tensor(name).to(dtype)


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config spelling; refuses rope types we do not run."""
    params = config.get("rope_parameters") or {
        **(config.get("rope_scaling") or {}),
        "rope_theta": config.get("rope_theta", 10000.0),
    }
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError("model.rope_scaling", kind, f"one of {', '.join(ROPE_TYPES)}")
    theta = float(params["rope_theta"])
    if kind == "default":
        return theta, None
    scaling = RopeScaling(
        kind=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings")
            or config.get("max_position_embeddings", 8192)
        ),
    )
    return theta, scaling


def parse_config(config: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a config.json dict; ConfigError for architectures the decoder cannot run."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError("model.model_type", model_type, f"one of {', '.join(ARCHITECTURES)}")
    declared = config.get("architectures") or [ARCHITECTURES[model_type]]
    if declared != [ARCHITECTURES[model_type]]:
        raise ConfigError("model.architectures", declared, f"[{ARCHITECTURES[model_type]!r}]")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError("model.hidden_act", config["hidden_act"], "silu")
    missing = [key for key in REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise ConfigError("model.config", f"missing {missing}", f"a config.json with {missing}")
    heads = config["num_attention_heads"]
    theta, scaling = _rope(config)
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = model_type == "qwen2" or attention_bias
    sliding = config.get("use_sliding_window", True)  # Qwen2 notes a window it does not use
    return ModelConfig(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        sliding_window=config.get("sliding_window") if sliding else None,
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"),
    )


def _weight_files(folder: Path) -> tuple[Path, ...]:
    """The safetensors files of a folder: those its shard index names, else all *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ConfigError("model.path", str(folder), f"{INDEX_FILE} names missing {missing}")
        return tuple(folder / name for name in shards)
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise ConfigError("model.path", str(folder), "a folder with *.safetensors weights")
    return files


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Validate a local Hugging Face folder (config.json + safetensors) without reading weights."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError("model.path", str(folder), "an existing local folder")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ConfigError("model.path", str(folder), f"a folder containing {CONFIG_FILE}")
    config = parse_config(json.loads(config_file.read_text()))
    return Checkpoint(folder=path, config=config, weight_files=_weight_files(path))
