"""Compressed sparse attention pooling: turn full cache blocks into summary vectors.

Each source block of block_size tokens becomes block_size / ratio summaries, the mean of each
aligned group of `ratio` consecutive tokens (keys, turned to the group's centre by the
`align` matrices of kvtune/kernels/cache/rope_align.py when given, so that RoPE does not cancel
them; values as they are), dequantized
from the source pool, averaged in fp32 and quantized into the destination pool's format, which
may differ from the source's (DESIGN.md section 3). ratio = 1 is a requantizing copy: it moves a
block leaving the unquantized recent window into a quantized pool. Call once for K and once for V.

Summary j of source block m goes to dst_slots[m * (block_size / ratio) + j]; a negative slot
skips it. The mean is sum_t x_t A_t (t in token order) / ratio in fp32, A_t = align[t] or the
identity.

A token-grouped destination (per-channel scales over a block) takes only ratio-1 copies of whole
blocks into whole, aligned destination blocks: each token group is quantized at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.quantize import (
    EXACT_ARITHMETIC,
    format_switches,
    load_dequant_tile,
    quantize_store_tile,
    quantize_store_token_groups,
    vector_tiles,
)

DOT_MIN_ROWS = 16  # tl.dot takes tiles of at least 16 rows


@triton.jit
def _compress_kernel(
    src_codes_ptr,
    src_scales_ptr,
    src_tensor_scale_ptr,
    src_block_ids_ptr,
    dst_codes_ptr,
    dst_scales_ptr,
    dst_tensor_scale_ptr,
    dst_slots_ptr,
    align_ptr,
    num_vectors,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RATIO: tl.constexpr,
    ALIGN: tl.constexpr,
    SRC_CODE: tl.constexpr,
    SRC_GROUP_SIZE: tl.constexpr,
    SRC_SCALE_DTYPE: tl.constexpr,
    SRC_TOKEN_GROUP: tl.constexpr,
    DST_CODE: tl.constexpr,
    DST_GROUP_SIZE: tl.constexpr,
    DST_SCALE_DTYPE: tl.constexpr,
    DST_TOKEN_GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_R (summary, head) vectors. Grid: cdiv(num summaries * H, BLOCK_R)."""
    SUMMARIES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // RATIO
    vectors = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = vectors < num_vectors
    summaries = vectors // NUM_HEADS
    heads = vectors % NUM_HEADS
    dst_slots = tl.load(dst_slots_ptr + summaries, mask=in_range, other=-1).to(tl.int64)
    mask = in_range & (dst_slots >= 0)
    blocks = tl.load(src_block_ids_ptr + summaries // SUMMARIES_PER_BLOCK, mask=mask, other=0)
    first_rows = blocks.to(tl.int64) * BLOCK_SIZE + (summaries % SUMMARIES_PER_BLOCK) * RATIO
    dims = tl.arange(0, BLOCK_D)
    # The sum starts from token 0 itself, not from 0.0, so that a -0.0 survives a ratio-1 copy.
    total = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for token in tl.static_range(RATIO):
        tile = load_dequant_tile(
            src_codes_ptr,
            src_scales_ptr,
            src_tensor_scale_ptr,
            first_rows + token,
            heads,
            mask,
            dims,
            NUM_HEADS,
            HEAD_DIM,
            SRC_CODE,
            SRC_GROUP_SIZE,
            SRC_SCALE_DTYPE,
            SRC_TOKEN_GROUP,
        )
        if ALIGN:
            square = dims[:, None] * HEAD_DIM + dims[None, :]
            inside = (dims[:, None] < HEAD_DIM) & (dims[None, :] < HEAD_DIM)
            turn = tl.load(align_ptr + token * HEAD_DIM * HEAD_DIM + square, mask=inside, other=0.0)
            tile = tl.dot(tile, turn, input_precision="ieee")
        if token == 0:
            total = tile
        else:
            total += tile
    mean = tl.math.div_rn(total, tl.full(total.shape, RATIO, tl.float32))
    quantize_store_tile(
        dst_codes_ptr,
        dst_scales_ptr,
        dst_tensor_scale_ptr,
        dst_slots,
        heads,
        mask,
        mean,
        NUM_HEADS,
        HEAD_DIM,
        DST_CODE,
        DST_GROUP_SIZE,
        DST_SCALE_DTYPE,
    )


@triton.jit
def _copy_token_groups_kernel(
    src_codes_ptr,
    src_scales_ptr,
    src_tensor_scale_ptr,
    src_block_ids_ptr,
    dst_codes_ptr,
    dst_scales_ptr,
    dst_tensor_scale_ptr,
    dst_slots_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SRC_CODE: tl.constexpr,
    SRC_GROUP_SIZE: tl.constexpr,
    SRC_SCALE_DTYPE: tl.constexpr,
    SRC_TOKEN_GROUP: tl.constexpr,
    DST_CODE: tl.constexpr,
    DST_GROUP_SIZE: tl.constexpr,
    DST_SCALE_DTYPE: tl.constexpr,
    DST_TOKEN_GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: one destination token group of one head. Grid: (blocks * groups, heads)."""
    GROUPS_PER_BLOCK: tl.constexpr = BLOCK_SIZE // DST_TOKEN_GROUP
    group = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(src_block_ids_ptr + group // GROUPS_PER_BLOCK).to(tl.int64)
    offset = (group % GROUPS_PER_BLOCK) * DST_TOKEN_GROUP
    src_rows = block * BLOCK_SIZE + offset + tl.arange(0, DST_TOKEN_GROUP)
    dst_first_row = tl.load(dst_slots_ptr + group * DST_TOKEN_GROUP)
    values = load_dequant_tile(
        src_codes_ptr,
        src_scales_ptr,
        src_tensor_scale_ptr,
        src_rows,
        head,
        tl.full((DST_TOKEN_GROUP,), True, tl.int1),
        tl.arange(0, BLOCK_D),
        NUM_HEADS,
        HEAD_DIM,
        SRC_CODE,
        SRC_GROUP_SIZE,
        SRC_SCALE_DTYPE,
        SRC_TOKEN_GROUP,
    )
    quantize_store_token_groups(
        dst_codes_ptr,
        dst_scales_ptr,
        dst_tensor_scale_ptr,
        dst_first_row,
        head,
        values,
        NUM_HEADS,
        HEAD_DIM,
        DST_CODE,
        DST_GROUP_SIZE,
        DST_SCALE_DTYPE,
    )


def _check_compress(
    src_pool: KVPool,
    src_block_ids: torch.Tensor,
    dst_pool: KVPool,
    dst_slots: torch.Tensor,
    ratio: int,
    align: torch.Tensor | None = None,
) -> None:
    """Raise early on a ratio, index tensor, alignment or pool pair that cannot be pooled."""
    if ratio < 1 or src_pool.block_size % ratio:
        raise ValueError(f"ratio={ratio}: must be >= 1 and divide block_size={src_pool.block_size}")
    head_dim = src_pool.head_dim
    if align is not None and (
        tuple(align.shape) != (ratio, head_dim, head_dim)
        or align.dtype != torch.float32
        or not align.is_contiguous()
    ):
        raise ValueError(
            f"align: must be contiguous fp32 [{ratio}, {head_dim}, {head_dim}], got "
            f"{align.dtype} {tuple(align.shape)}"
        )
    if (src_pool.num_heads, src_pool.head_dim) != (dst_pool.num_heads, dst_pool.head_dim):
        raise ValueError(
            f"src_pool and dst_pool: need equal heads and head_dim, got "
            f"{(src_pool.num_heads, src_pool.head_dim)} and "
            f"{(dst_pool.num_heads, dst_pool.head_dim)}"
        )
    for name, index in (("src_block_ids", src_block_ids), ("dst_slots", dst_slots)):
        if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: must be 1-D int32 or int64, got {index.dtype}")
    if dst_pool.fmt.token_group > 1 and ratio != 1:
        raise ValueError(
            f"ratio={ratio}: {dst_pool.fmt} shares scales across tokens and takes only whole "
            "blocks (ratio 1)"
        )
    expected = src_block_ids.shape[0] * (src_pool.block_size // ratio)
    if dst_slots.shape[0] != expected:
        raise ValueError(
            f"dst_slots has {dst_slots.shape[0]} entries: expected {expected} "
            f"({src_block_ids.shape[0]} blocks x {src_pool.block_size // ratio} summaries)"
        )


def compress_blocks(
    src_pool: KVPool,
    src_block_ids: torch.Tensor,
    dst_pool: KVPool,
    dst_slots: torch.Tensor,
    ratio: int,
    align: torch.Tensor | None = None,
) -> None:
    """Pool full source blocks src_block_ids [M] into summaries at dst_slots
    [M * block_size / ratio] of dst_pool (in place; see the module docstring); align: fp32
    [ratio, D, D] turns of the pooled keys, or None."""
    _check_compress(src_pool, src_block_ids, dst_pool, dst_slots, ratio, align)
    num_heads, head_dim = src_pool.num_heads, src_pool.head_dim
    num_vectors = dst_slots.shape[0] * num_heads
    if num_vectors == 0:
        return
    if dst_pool.fmt.token_group > 1:
        _copy_token_groups(src_pool, src_block_ids, dst_pool, dst_slots)
        return
    programs, block_r, block_d = vector_tiles(num_vectors, head_dim)
    if align is not None and block_r < DOT_MIN_ROWS:
        block_r = DOT_MIN_ROWS
        programs = triton.cdiv(num_vectors, block_r)
    _compress_kernel[(programs,)](
        src_pool.codes,
        src_pool.scales if src_pool.scales is not None else src_pool.codes,
        src_pool.tensor_scale,
        src_block_ids.contiguous(),
        dst_pool.codes,
        dst_pool.scales if dst_pool.scales is not None else dst_pool.codes,
        dst_pool.tensor_scale,
        dst_slots.contiguous(),
        align if align is not None else src_pool.tensor_scale,
        num_vectors,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=src_pool.block_size,
        RATIO=ratio,
        ALIGN=align is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **format_switches(src_pool.fmt, "SRC_"),
        **format_switches(dst_pool.fmt, "DST_"),
        **EXACT_ARITHMETIC,
    )


def _copy_token_groups(
    src_pool: KVPool, src_block_ids: torch.Tensor, dst_pool: KVPool, dst_slots: torch.Tensor
) -> None:
    """Ratio-1 copy of whole blocks into a token-grouped pool (dst_slots: whole, aligned
    blocks, as the block manager hands out)."""
    groups = dst_slots.shape[0] // dst_pool.fmt.token_group
    _copy_token_groups_kernel[(groups, src_pool.num_heads)](
        src_pool.codes,
        src_pool.scales if src_pool.scales is not None else src_pool.codes,
        src_pool.tensor_scale,
        src_block_ids.contiguous(),
        dst_pool.codes,
        dst_pool.scales,
        dst_pool.tensor_scale,
        dst_slots.contiguous(),
        NUM_HEADS=src_pool.num_heads,
        HEAD_DIM=src_pool.head_dim,
        BLOCK_SIZE=src_pool.block_size,
        BLOCK_D=triton.next_power_of_2(src_pool.head_dim),
        **format_switches(src_pool.fmt, "SRC_"),
        **format_switches(dst_pool.fmt, "DST_"),
        **EXACT_ARITHMETIC,
    )


def compress_blocks_ref(
    src_pool: KVPool,
    src_block_ids: torch.Tensor,
    dst_pool: KVPool,
    dst_slots: torch.Tensor,
    ratio: int,
    align: torch.Tensor | None = None,
) -> None:
    """Torch reference of `compress_blocks` (same signature; the same bits without align, the
    same up to the kernel's fp32 summation order with it)."""
    _check_compress(src_pool, src_block_ids, dst_pool, dst_slots, ratio, align)
    block_size = src_pool.block_size
    offsets = torch.arange(block_size, device=src_block_ids.device)
    rows = src_block_ids.long()[:, None] * block_size + offsets
    tokens = read_vectors_ref(src_pool, rows.flatten())
    groups = tokens.unflatten(0, (-1, ratio))  # [summaries, ratio, heads, head_dim]
    if align is not None:  # in fp64, rounded once: the same bits whatever the batch of blocks
        groups = torch.einsum("strd,tde->stre", groups.double(), align.double()).float()
    total = groups[:, 0]
    for token in range(1, ratio):
        total = total + groups[:, token]
    write_vectors_ref(dst_pool, dst_slots, total / ratio)
