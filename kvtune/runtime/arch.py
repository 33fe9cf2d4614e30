"""ModelArch: the few architecture numbers that decide KV-cache size, from a preset or config.json.

Reading config.json alone (no weights) lets the planner and the policy checks run in
milliseconds, before any expensive loading starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.kernels.formats.kv_format import ELEMENT_BITS, TORCH_DTYPES
from kvtune.runtime.dtypes import DTYPE_SPELLINGS
from kvtune.runtime.errors import ConfigError

GIB = 1 << 30
WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.gguf")


@dataclass(frozen=True)
class ModelArch:
    """What the KV cache of a decoder needs to know about the model.

    kv_lora_rank > 0 marks an MLA model (DeepSeek V2/V3): it caches one latent vector of
    kv_lora_rank + qk_rope_head_dim elements per token and layer instead of K and V per head.
    weights_bytes: memory the weights occupy on the device (bytes).
    dtype: the compute dtype (fp32 | fp16 | bf16), used for `auto` cache streams.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    weights_bytes: int
    max_position_embeddings: int
    dtype: str = "bf16"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name}", value, "a positive integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                "model.num_kv_heads",
                self.num_kv_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.weights_bytes < 0:
            raise ConfigError("model.weights_gib", self.weights_bytes / GIB, "a number >= 0")
        if self.dtype not in TORCH_DTYPES:
            raise ConfigError("model.dtype", self.dtype, f"one of {', '.join(TORCH_DTYPES)}")

    def check_context(self, tokens: int, field: str) -> None:
        """Refuse a context (tokens) longer than the positions the model was trained on."""
        if tokens > self.max_position_embeddings:
            raise ConfigError(
                field,
                tokens,
                f"at most {self.name}'s max_position_embeddings "
                f"({self.max_position_embeddings} tokens)",
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cached_heads(self) -> int:
        """Vectors cached per token and layer for K (and again for V unless MLA)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cached_vector_size(self) -> int:
        """Elements of one cached vector: head_dim, or the MLA latent width."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim


def _estimated_weight_bytes(config: dict[str, Any], dtype_bytes: int) -> int:
    """Parameter count of a Llama-family decoder from its config, times bytes a parameter."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config["intermediate_size"]
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return (layers * (attention + mlp + 2 * hidden) + embeddings + hidden) * dtype_bytes


def _weight_file_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for pattern in WEIGHT_FILE_PATTERNS for f in folder.glob(pattern))


def arch_from_folder(folder: str | Path) -> ModelArch:
    """ModelArch of a local Hugging Face folder, from its config.json and weight file sizes."""
    path = Path(folder).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError("model.path", str(folder), "a local folder containing config.json")
    config = json.loads(config_file.read_text())
    # transformers >= 5 writes the checkpoint dtype as "dtype", earlier ones as "torch_dtype".
    declared = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = DTYPE_SPELLINGS.get(str(declared), "bf16")
    heads = config["num_attention_heads"]
    weights = _weight_file_bytes(path) or _estimated_weight_bytes(config, ELEMENT_BITS[dtype] // 8)
    return ModelArch(
        name=path.name,
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        weights_bytes=weights,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        dtype=dtype,
        kv_lora_rank=config.get("kv_lora_rank") or 0,
        qk_rope_head_dim=config.get("qk_rope_head_dim") or 0,
    )
