"""Decode attention: one query a sequence over one paged stream, split-KV in two stages.

Decode is memory-bound and has little parallelism per sequence (one query token), so stage 1
splits each sequence's keys into `num_splits` ranges processed by separate programs (partial
output + LSE each), and stage 2 merges the splits by LSE. The query sits after every stored key,
so no causal mask is applied. All GQA query heads of a KV head share one program, so each K/V
tile is read from memory once.
"""

from __future__ import annotations

import torch
import triton

from kvtune.kernels.attention.merge import merge_stacked
from kvtune.kernels.attention.paged import (
    PagedStream,
    paged_attention_partials,
    paged_attention_ref,
)

# Aim for a few programs per streaming multiprocessor (an H100/H200 has 132).
TARGET_PROGRAMS = 512
MAX_SPLITS = 64


def default_num_splits(num_seqs: int, num_kv_heads: int) -> int:
    """Splits per sequence that fill the GPU without knowing lengths (no device-host sync)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))))


def _decode_seq_starts(q: torch.Tensor) -> torch.Tensor:
    return torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)


def decode_attention(
    q: torch.Tensor,
    stream: PagedStream,
    scale: float,
    num_splits: int | None = None,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [num_seqs, Hq, D] (one token a sequence) over all keys of `stream`.

    num_splits: key ranges per sequence (None: `default_num_splits`); empty splits cost one
    early-exiting program. Returns out fp32 [num_seqs, Hq, D] and natural-log lse fp32
    [num_seqs, Hq]; a sequence with no stored key gets out 0 and lse -inf.
    """
    if q.dim() != 3 or q.shape[0] != stream.num_seqs:
        raise ValueError(f"q.shape={tuple(q.shape)}: must be [num_seqs={stream.num_seqs}, Hq, D]")
    if num_splits is None:
        num_splits = default_num_splits(stream.num_seqs, stream.num_kv_heads)
    parts_out, parts_lse = paged_attention_partials(
        q, None, _decode_seq_starts(q), stream, scale, 1, num_splits, dot_precision
    )
    if num_splits == 1:
        return parts_out[0], parts_lse[0]
    return merge_stacked(parts_out, parts_lse)


def decode_attention_ref(
    q: torch.Tensor,
    stream: PagedStream,
    scale: float,
    num_splits: int | None = None,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `decode_attention` (fp32: the result depends on neither num_splits nor
    dot_precision)."""
    return paged_attention_ref(q, None, _decode_seq_starts(q), stream, scale)
