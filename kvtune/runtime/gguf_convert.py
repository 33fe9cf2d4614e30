"""Convert a llama or qwen2 GGUF file once into a Hugging Face-style folder.

Reading a GGUF costs seconds (metadata parsing, dequantization); the folder it becomes loads in
about a second, memory-mapped, through the same safetensors path as any Hub checkpoint
(kvtune/runtime/checkpoint.py). The folder holds:

- config.json: the transformers config of the file's `general.architecture` from its metadata,
  torch_dtype float32;
- model.safetensors: the weights dequantized with gguf.quants.dequantize into float32, which
  holds every dequantized value exactly (a Q4/Q5/Q8 value is an fp16 scale times a small integer
  plus an fp16 offset), in Hugging Face layout;
- tokenizer.json: the byte-level BPE vocabulary, merges and control tokens, with the
  pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`;
- tokenizer_config.json: special tokens and the chat template.

What differs between architectures is written once, in GGUF_ARCHITECTURES: the transformers
model type, whether llama.cpp interleaved the q/k rows for RoPE (its llama converter does, its
qwen2 converter does not), which projections carry biases, and config fields of their own.

The folder is written under a temporary name and renamed into place, so an interrupted
conversion never leaves a partial folder behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvtune.runtime.checkpoint import ARCHITECTURES
from kvtune.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

CONTROL_TOKEN = 3  # llama.cpp token types: 1 normal, 3 control, 4 user-defined, 5 unused
USER_DEFINED_TOKEN = 4
# GGUF tensor names -> Hugging Face names; per layer after "blk.N.", without .weight/.bias.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF `general.architecture` becomes a transformers decoder.

    model_type: config.json's model_type (a key of checkpoint.ARCHITECTURES).
    permuted_rope_rows: llama.cpp stored the q/k rows of each head interleaved for its RoPE.
    biased: the per-layer tensors (LAYER_TENSORS keys) that also have a bias.
    config: config.json fields of this architecture alone.
    """

    model_type: str
    permuted_rope_rows: bool
    biased: frozenset[str] = frozenset()
    config: Mapping[str, Any] = field(default_factory=dict)


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture(
        "llama", permuted_rope_rows=True, config={"attention_bias": False, "mlp_bias": False}
    ),
    # Qwen2 notes a sliding window that its released models leave off.
    "qwen2": GGUFArchitecture(
        "qwen2",
        permuted_rope_rows=False,
        biased=frozenset({"attn_q", "attn_k", "attn_v"}),
        config={"use_sliding_window": False},
    ),
}
ROPE_ROWS = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """llama.cpp's "smollm": every \\p{N} character alone, then the GPT-2 split (as SmolLM's own
    tokenizer.json: Digits(individual_digits) then ByteLevel)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """llama.cpp's "qwen2": its regex (GPT-4's, with single digits), then byte-level bytes.
    Qwen2's own tokenizer.json also applies NFC first; llama.cpp does not, nor do we."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> the equivalent `tokenizers` pre-tokenizer.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _smollm_pre_tokenizer,
    "qwen2": _qwen2_pre_tokenizer,
}


class _Metadata:
    """Typed access to a GGUF's key/value metadata, refusing what the converter cannot honour."""

    def __init__(self, reader: GGUFReader, source: Path) -> None:
        self.reader = reader
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        entry = self.reader.fields.get(key)
        return default if entry is None else entry.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError("model.gguf", str(self.source), f"a GGUF with metadata {key}")
        return value

    def refuse(self, what: object, allowed: str) -> ConfigError:
        return ConfigError("model.gguf", f"{self.source.name}: {what}", allowed)

    def architecture(self) -> tuple[str, GGUFArchitecture]:
        """general.architecture and how it converts; refused unless in GGUF_ARCHITECTURES."""
        name = self.get("general.architecture")
        if name not in GGUF_ARCHITECTURES:
            raise self.refuse(name, f"a GGUF of architecture {' or '.join(GGUF_ARCHITECTURES)}")
        return name, GGUF_ARCHITECTURES[name]


def _shortest_float32(value: float) -> float:
    """The shortest decimal of a float32 (GGUF stores 1e-05 as 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: _Metadata, tensor_names: set[str]) -> dict[str, Any]:
    """config.json of the decoder the GGUF describes (transformers' config fields)."""
    name, architecture = meta.architecture()
    prefix = name + "."
    hidden = meta.require(prefix + "embedding_length")
    heads = meta.require(prefix + "attention.head_count")
    head_dim = meta.get(prefix + "attention.key_length", hidden // heads)
    if meta.get(prefix + "rope.dimension_count", head_dim) != head_dim:
        raise meta.refuse("partial rotary embedding", "RoPE over the whole head_dim")
    if meta.get(prefix + "rope.scaling.type", "none") != "none":
        raise meta.refuse(meta.get(prefix + "rope.scaling.type"), "a GGUF without RoPE scaling")
    tokens = meta.require("tokenizer.ggml.tokens")
    eps = meta.require(prefix + "attention.layer_norm_rms_epsilon")
    return {
        "architectures": [ARCHITECTURES[architecture.model_type]],
        "model_type": architecture.model_type,
        "vocab_size": meta.get(prefix + "vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": meta.require(prefix + "feed_forward_length"),
        "num_hidden_layers": meta.require(prefix + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(prefix + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.require(prefix + "context_length"),
        "rms_norm_eps": _shortest_float32(eps),
        "rope_theta": _shortest_float32(meta.get(prefix + "rope.freq_base", 10000.0)),
        **architecture.config,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _hf_tensor_name(meta: _Metadata, name: str) -> tuple[str, str | None]:
    """(Hugging Face name, LAYER_TENSORS key or None) of a GGUF tensor; refuses any tensor the
    file's architecture does not have."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name], None
    architecture_name, architecture = meta.architecture()
    block, _, rest = name.partition(".")[2].partition(".")
    stem, _, kind = rest.rpartition(".")
    known = kind == "weight" or (kind == "bias" and stem in architecture.biased)
    if name.startswith("blk.") and block.isdigit() and stem in LAYER_TENSORS and known:
        return f"model.layers.{block}.{LAYER_TENSORS[stem]}.{kind}", stem
    raise meta.refuse(f"tensor {name}", f"the tensors of a {architecture_name} decoder")


def unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for RoPE (weights and biases alike: rows come first).

    Within each head llama.cpp interleaves the two rotated halves (rows 0, D/2, 1, D/2 + 1, ...);
    transformers keeps the first half, then the second.
    """
    rows = weight.shape[0]
    interleaved = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return interleaved.swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(meta: _Metadata, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, renamed and laid out as transformers' decoder."""
    _, architecture = meta.architecture()
    tensors = {}
    for tensor in meta.reader.tensors:
        name, stem = _hf_tensor_name(meta, tensor.name)
        shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        if architecture.permuted_rope_rows and stem in ROPE_ROWS:
            weight = unpermute_rope_rows(weight, config[ROPE_ROWS[stem]])
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def _hf_tokenizer(meta: _Metadata) -> Tokenizer:
    """Byte-level BPE tokenizer of the GGUF vocabulary, merges and control tokens."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise meta.refuse(meta.get("tokenizer.ggml.model"), "a byte-level BPE (gpt2) tokenizer")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise meta.refuse(f"pre-tokenizer {pre}", f"one of {', '.join(PRE_TOKENIZERS)}")
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_eos_token"):
        raise meta.refuse("add_bos_token/add_eos_token", "a tokenizer adding no special tokens")
    tokens = meta.require("tokenizer.ggml.tokens")
    token_types = meta.require("tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ")) for merge in meta.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    control = [t for t, kind in typed if kind == CONTROL_TOKEN]
    user_defined = [t for t, kind in typed if kind == USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in user_defined])
    return tokenizer


def _hf_tokenizer_config(meta: _Metadata, context_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by name, and the chat template."""
    tokens = meta.require("tokenizer.ggml.tokens")
    names = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    special = {
        name: tokens[meta.get(f"tokenizer.ggml.{key}")]
        for name, key in names.items()
        if meta.get(f"tokenizer.ggml.{key}") is not None
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _write_folder(gguf_file: Path, folder: Path) -> None:
    meta = _Metadata(GGUFReader(gguf_file), gguf_file)
    meta.architecture()  # an unknown architecture is refused before anything is read
    config = _hf_config(meta, {tensor.name for tensor in meta.reader.tensors})
    tokenizer = _hf_tokenizer(meta)
    tokenizer_config = _hf_tokenizer_config(meta, config["max_position_embeddings"])
    save_file(_hf_tensors(meta, config), str(folder / "model.safetensors"), {"format": "pt"})
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def convert_gguf(gguf_file: str | Path, folder: str | Path) -> Path:
    """Write the Hugging Face folder of gguf_file at folder (which must not exist yet).

    The files go to a temporary sibling that is renamed to folder when complete; if another
    process finished the same conversion first, its folder is kept and ours discarded.
    """
    source, target = Path(gguf_file), Path(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("converting %s into %s (once)", source.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_folder(source, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("%s was converted concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s", source.name, time.perf_counter() - started)
    return target
