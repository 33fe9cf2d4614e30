"""Decode-time block scoring on the Triton path: each query head's product with every index
vector of its sequence, read from the index pools where they lie.

A decode step scores every older block in every layer. The torch path
(`kvtune.kernels.selection.blocks.index_products_torch`) gathers the index, dequantizes it into fp32
temporaries and multiplies; here one program per (sequence, KV head, tile of index vectors)
dequantizes a tile in registers and multiplies it with the KV head's query heads, so the index
is read once, in its own format, and nothing but the products [S, Hq, L] is written.
`kvtune.kernels.selection.blocks.select_blocks` turns the products into block scores and picks the
top k the same way for both paths, so they choose alike.

Products by rule (`kind`):
- bounds: sum_d max(q_d hi_d, q_d lo_d) = max(q, 0) . hi + min(q, 0) . lo, the per-channel
  maxima hi in the stream's K pool and minima lo in its V pool (Quest's upper bound of q.k);
- means, summaries: q . k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.formats.quantize import format_switches, load_dequant_tile

# Index elements a program dequantizes at once (BLOCK_L vectors of BLOCK_D). Compiled for sm_90
# at 4 warps, 2048 keeps bounds at 124 registers a thread with no spills, where 64 vectors of
# 128 spill (benchmarks/kernel_registers.py).
TILE_ELEMENTS = 2048


def tile_vectors(head_dim: int) -> int:
    """Index vectors one program scores."""
    return max(16, TILE_ELEMENTS // triton.next_power_of_2(head_dim))


@triton.jit
def _index_products_kernel(
    q_ptr,
    k_codes_ptr,
    k_scales_ptr,
    k_tensor_scale_ptr,
    v_codes_ptr,
    v_scales_ptr,
    v_tensor_scale_ptr,
    block_table_ptr,
    lengths_ptr,
    out_ptr,
    stride_q_seq,
    stride_q_head,
    stride_block_table,
    stride_out_seq,
    stride_out_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BOUNDS: tl.constexpr,
    K_CODE: tl.constexpr,
    K_GROUP_SIZE: tl.constexpr,
    K_SCALE_DTYPE: tl.constexpr,
    K_TOKEN_GROUP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_GROUP_SIZE: tl.constexpr,
    V_SCALE_DTYPE: tl.constexpr,
    V_TOKEN_GROUP: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Products of one sequence's query heads of one KV head with one tile of its index.

    Grid: (num_seqs, num_kv_heads, cdiv(longest length, BLOCK_L)); tiles past a sequence's
    length store nothing. The tile is dequantized once and multiplied with each query head in
    fp32 on the vector units: a handful of query heads would waste most of a tl.dot tile, and
    tf32 dots could reorder a top k.
    """
    group: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_L
    length = tl.load(lengths_ptr + seq)
    if first < length:
        dims = tl.arange(0, BLOCK_D)
        vectors = first + tl.arange(0, BLOCK_L)
        valid = vectors < length
        table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
        blocks = tl.load(table_row + vectors // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + vectors % BLOCK_SIZE
        keys = load_dequant_tile(
            k_codes_ptr,
            k_scales_ptr,
            k_tensor_scale_ptr,
            slots,
            kv_head,
            valid,
            dims,
            NUM_KV_HEADS,
            HEAD_DIM,
            K_CODE,
            K_GROUP_SIZE,
            K_SCALE_DTYPE,
            K_TOKEN_GROUP,
        )
        if BOUNDS:
            lows = load_dequant_tile(
                v_codes_ptr,
                v_scales_ptr,
                v_tensor_scale_ptr,
                slots,
                kv_head,
                valid,
                dims,
                NUM_KV_HEADS,
                HEAD_DIM,
                V_CODE,
                V_GROUP_SIZE,
                V_SCALE_DTYPE,
                V_TOKEN_GROUP,
            )
        for member in tl.static_range(group):
            head = kv_head * group + member
            q_row = q_ptr + seq.to(tl.int64) * stride_q_seq + head * stride_q_head
            q = tl.load(q_row + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
            if BOUNDS:
                terms = tl.maximum(q, 0.0)[None, :] * keys + tl.minimum(q, 0.0)[None, :] * lows
            else:
                terms = q[None, :] * keys
            out_row = out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head
            tl.store(out_row + vectors, tl.sum(terms, axis=1), mask=valid)


def index_products(q: torch.Tensor, index: PagedStream, length: int, kind: str) -> torch.Tensor:
    """fp32 [S, Hq, length]: each decode query q [S, Hq, D] (one a sequence, in the index's
    basis) with each of its sequence's index vectors by the rule of `kind` (module docstring);
    0 past a sequence's length. length: the longest of index.lengths."""
    num_seqs, num_q_heads, head_dim = q.shape
    if num_seqs != index.num_seqs or head_dim != index.head_dim or q.stride(-1) != 1:
        raise ValueError(
            f"q.shape={tuple(q.shape)}: must be unit-strided [{index.num_seqs}, Hq, "
            f"{index.head_dim}]"
        )
    if num_q_heads % index.num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads}: must be a multiple of num_kv_heads={index.num_kv_heads}"
        )
    out = torch.zeros(num_seqs, num_q_heads, length, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or length == 0:
        return out
    block_l = tile_vectors(head_dim)
    grid = (num_seqs, index.num_kv_heads, triton.cdiv(length, block_l))
    k, v = index.k, index.v
    _index_products_kernel[grid](
        q,
        k.codes,
        # A format without group scales never reads its scales pointer: pass the codes.
        k.scales if k.scales is not None else k.codes,
        k.tensor_scale,
        v.codes,
        v.scales if v.scales is not None else v.codes,
        v.tensor_scale,
        index.block_table,
        index.lengths,
        out,
        q.stride(0),
        q.stride(1),
        index.block_table.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=index.num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=index.block_size,
        BOUNDS=kind == "bounds",
        **format_switches(k.fmt, "K_"),
        **format_switches(v.fmt, "V_"),
        BLOCK_L=block_l,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
