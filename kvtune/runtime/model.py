"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch, with pluggable attention.

The model knows nothing of the KV cache. A step's tokens arrive packed: N tokens of possibly
several sequences, each with its own position. Every layer projects q, k and v, applies RoPE to
q and k, and hands them to the caller's `attention(layer_index, q, k, v)`, which stores k and v
wherever it keeps its cache (post-RoPE keys, so cached keys never need rotating again) and returns
the attention output for the N queries. `DenseCausalAttention` is the exact reference: whole
sequences, no cache.

    model = DecoderModel.from_checkpoint(folder, dtype="fp32")
    hidden = model(input_ids, positions, DenseCausalAttention([len(input_ids)]))
    next_token = model.logits(hidden[-1:]).argmax(-1)

Numerics follow transformers' Llama: RoPE angles and RMSNorm in fp32, everything else in the
model dtype, so fp32 logits agree with transformers to rounding.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvtune.kernels.formats.kv_format import TORCH_DTYPES
from kvtune.runtime.checkpoint import ModelConfig, open_checkpoint
from kvtune.runtime.errors import ConfigError

logger = logging.getLogger(__name__)


class Attention(Protocol):
    """Attention for one layer over a packed step.

    q: [N, num_attention_heads, head_dim], k and v: [N, num_kv_heads, head_dim], RoPE already
    applied to q and k. Returns [N, num_attention_heads, head_dim] in q's dtype.
    """

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class DenseCausalAttention:
    """Exact causal attention over whole sequences packed one after another, without a cache.

    seq_lens: tokens of each sequence, in packing order; each sequence's tokens must be its
    positions 0..len-1 (a full recompute). GQA: query head h reads KV head h // (Hq / Hkv).
    """

    def __init__(self, seq_lens: Sequence[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        outputs = []
        for q_seq, k_seq, v_seq in zip(
            q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens), strict=True
        ):
            out = F.scaled_dot_product_attention(
                q_seq.transpose(0, 1),
                k_seq.transpose(0, 1),
                v_seq.transpose(0, 1),
                is_causal=True,
                enable_gqa=True,
            )
            outputs.append(out.transpose(0, 1))
        return torch.cat(outputs)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or from its short name (fp32 | fp16 | bf16)."""
    if isinstance(dtype, torch.dtype) and dtype in TORCH_DTYPES.values():
        return dtype
    if dtype not in TORCH_DTYPES:
        raise ConfigError("model.dtype", dtype, f"one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype]


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotation speed (radians a position) of each of the head_dim / 2 RoPE pairs, fp32, CPU.

    Llama 3 scaling slows the low frequencies (wavelength above original context / low_freq_factor)
    by `factor`, keeps the high ones (below original context / high_freq_factor) and blends
    linearly in 1 / wavelength between the two.
    """
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    slowed = inv_freq / scaling.factor
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    medium = (1 - blend) * slowed + blend * inv_freq
    is_low = wavelength > context / scaling.low_freq_factor
    is_high = wavelength < context / scaling.high_freq_factor
    return torch.where(is_low, slowed, torch.where(is_high, inv_freq, medium))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by the angles of its token: cos, sin [N, D] (half-split pair layout)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


# Projections that read the same input, stored as one matrix (a checkpoint's rows stacked in
# this order) so that a decode step reads them in one matmul instead of several small ones.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The checkpoint's state with each layer's FUSED_PROJECTIONS stacked into one weight (and
    bias, where the checkpoint has them)."""
    fused = dict(state)
    for layer in range(num_layers):
        for target, parts in FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"layers.{layer}.{part}.{kind}" for part in parts]
                if names[0] in fused:
                    stacked = torch.cat([fused.pop(name) for name in names])
                    fused[f"layers.{layer}.{target}.{kind}"] = stacked
    return fused


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    """q/k/v projections, RoPE, the caller's attention, output projection."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        self.splits = (q_size, kv_size, kv_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.layer_index, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The decoder stack; parameter names are the checkpoint's without the `model.` prefix.

    With tied embeddings (lm_head is None) the output projection is the embedding matrix.
    Choose the dtype when loading (from_checkpoint): `.to(dtype)` would also round the fp32
    RoPE frequencies.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An uninitialised weight: random init of this matrix on the meta device costs seconds.
        embeddings = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embeddings)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Final-norm hidden states [N, hidden_size] of N packed tokens (ids, positions: [N])."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, vocab_size] of M hidden states: call it only where a token is sampled."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @classmethod
    def from_checkpoint(
        cls,
        folder: str | Path,
        dtype: torch.dtype | str = "fp32",
        device: torch.device | str = "cpu",
    ) -> DecoderModel:
        """Load a Llama/Mistral/Qwen2 safetensors checkpoint folder in dtype on device.

        The folder and config are validated before any weight is read; every parameter must
        appear in the checkpoint exactly once (a redundant lm_head of a tied model is ignored).
        """
        started = time.perf_counter()
        torch_dtype = resolve_dtype(dtype)
        checkpoint = open_checkpoint(folder)
        with torch.device("meta"):
            model = cls(checkpoint.config)
        state = {
            name.removeprefix("model."): tensor.to(device)
            for name, tensor in checkpoint.tensors(torch_dtype)
            if not (model.lm_head is None and name == "lm_head.weight")
        }
        state = fuse_projections(state, checkpoint.config.num_layers)
        model.load_state_dict(state, strict=True, assign=True)
        model.to(device).requires_grad_(False).eval()
        logger.info(
            "loaded %s (%s layers, %s) in %.2f s",
            checkpoint.folder.name,
            checkpoint.config.num_layers,
            torch_dtype,
            time.perf_counter() - started,
        )
        return model
