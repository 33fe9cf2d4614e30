"""The two implementations of the cache operations: Triton kernels or their torch references.

`torch` runs torch ops (the CPU default): the references for writes, compression and merging,
and the batched torch attention (kernels/attention_torch.py, checked against the per-sequence
reference). `triton` runs the kernels (GPU, or the CPU under TRITON_INTERPRET=1 for tests).
Both share signatures, so the cache code is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels.attention import stream_attention
from kernels.attention_decode import decode_attention
from kernels.attention_merge import merge_attention, merge_attention_ref
from kernels.attention_torch import decode_attention_torch, stream_attention_torch
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


BACKENDS: dict[str, CacheOps] = {
    "torch": CacheOps(
        write_kv_ref,
        stream_attention_torch,
        decode_attention_torch,
        merge_attention_ref,
        compress_blocks_ref,
    ),
    "triton": CacheOps(
        write_kv, stream_attention, decode_attention, merge_attention, compress_blocks
    ),
}


def cache_ops(backend: str) -> CacheOps:
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"one of {', '.join(BACKENDS)}")
    return BACKENDS[backend]
