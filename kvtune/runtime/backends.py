"""The two implementations of the cache operations: Triton kernels or their torch references.

`torch` runs torch ops (the CPU default): the references for writes and compression, and
attention over all of a sequence's streams in one fused SDPA call (kernels/attention_torch.py,
checked against the per-stream references merged by log-sum-exp). `triton` runs the kernels
(GPU, or the CPU under TRITON_INTERPRET=1 for tests): one attention launch per stream, then the
merge kernel, and one launch to score a decode step's index, with fp32 (ieee) dot products.
`triton_tf32` is the same with tf32 tensor-core dots in attention on a GPU (index scores stay
fp32: a top k must not turn on rounding): it stays a separate backend until a GPU run shows
what tf32 costs in logits and retention (benchmarks/gpu_check.sh measures it). All share
signatures, so the cache code is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvtune.kernels.attention.decode import decode_attention
from kvtune.kernels.attention.merge import merge_attention
from kvtune.kernels.attention.paged import PagedStream, stream_attention
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from kvtune.kernels.cache.compress import compress_blocks, compress_blocks_ref
from kvtune.kernels.cache.write import write_kv, write_kv_torch
from kvtune.kernels.selection.blocks import IndexProducts, index_products_torch
from kvtune.kernels.selection.decode_scores import index_products
from kvtune.runtime.errors import ConfigError


@dataclass(frozen=True)
class CacheOps:
    write_kv: Callable
    compress_blocks: Callable
    # fp32 [Nq, Hq, D] of packed queries over a list of streams that together are each
    # sequence's cache; positions None = decode.
    attention: Callable
    # fp32 [S, Hq, L] products of one decode query a sequence with its index vectors, which
    # block selection turns into picks (`kvtune.kernels.selection.blocks.IndexProducts`).
    index_products: IndexProducts


def cache_attention_triton(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    streams: Sequence[PagedStream],
    scale: float,
    max_q_len: int | None = None,
    dot_precision: str = "ieee",
) -> torch.Tensor:
    """One kernel launch per stream; several streams' partials merged by log-sum-exp."""
    if q_positions is None:
        partials = [
            decode_attention(q, stream, scale, dot_precision=dot_precision) for stream in streams
        ]
    else:
        partials = [
            stream_attention(q, q_positions, q_seq_starts, stream, scale, max_q_len, dot_precision)
            for stream in streams
        ]
    return partials[0][0] if len(partials) == 1 else merge_attention(partials)[0]


BACKENDS: dict[str, CacheOps] = {
    "torch": CacheOps(
        write_kv_torch, compress_blocks_ref, cache_attention_torch, index_products_torch
    ),
    "triton": CacheOps(write_kv, compress_blocks, cache_attention_triton, index_products),
    "triton_tf32": CacheOps(
        write_kv,
        compress_blocks,
        partial(cache_attention_triton, dot_precision="tf32"),
        index_products,
    ),
}


def cache_ops(backend: str) -> CacheOps:
    if backend not in BACKENDS:
        raise ConfigError("backend", backend, f"one of {', '.join(BACKENDS)}")
    return BACKENDS[backend]
