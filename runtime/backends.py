"""The two implementations of the cache operations: Triton kernels or their torch references.

`torch` runs torch ops (the CPU default): the references for writes, compression and merging,
and the batched torch attention (kernels/attention_torch.py, checked against the per-sequence
reference). `triton` runs the kernels (GPU, or the CPU under TRITON_INTERPRET=1 for tests).
Both share signatures, so the cache code is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention import PagedStream, stream_attention
from kernels.attention_decode import decode_attention
from kernels.attention_merge import merge_attention, merge_attention_ref
from kernels.attention_torch import (
    decode_attention_torch,
    single_stream_attention_torch,
    stream_attention_torch,
)
from kernels.cache_write import write_kv, write_kv_ref
from kernels.compress import compress_blocks, compress_blocks_ref
from runtime.errors import ConfigError


@dataclass(frozen=True)
class CacheOps:
    write_kv: Callable
    stream_attention: Callable
    decode_attention: Callable
    merge_attention: Callable
    compress_blocks: Callable
    # Attention when one stream is each sequence's whole cache (no LSE to merge); positions
    # None = decode.
    single_stream_attention: Callable


def single_stream_attention_triton(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    if q_positions is None:
        return decode_attention(q, stream, scale)[0]
    return stream_attention(q, q_positions, q_seq_starts, stream, scale, max_q_len)[0]


BACKENDS: dict[str, CacheOps] = {
    "torch": CacheOps(
        write_kv_ref,
        stream_attention_torch,
        decode_attention_torch,
        merge_attention_ref,
        compress_blocks_ref,
        single_stream_attention_torch,
    ),
    "triton": CacheOps(
        write_kv,
        stream_attention,
        decode_attention,
        merge_attention,
        compress_blocks,
        single_stream_attention_triton,
    ),
}


def cache_ops(backend: str) -> CacheOps:
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"one of {', '.join(BACKENDS)}")
    return BACKENDS[backend]
