"""Fused write of new K and V vectors into paged pools, quantizing inside the kernel.

Each new token's K and V go straight from the model's activations to their slots' codes and
scales: no fp16 copy of the cache is ever made. slot_mapping[n] = block_id * block_size + offset
is token n's slot; a negative slot skips the token (padding). Two tokens mapped to the same slot
leave either one's vector there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.cache.pool import KVPool, write_vectors_ref
from kvtune.kernels.formats.quantize import (
    EXACT_ARITHMETIC,
    format_switches,
    quantize_store_tile,
    vector_tiles,
)
from kvtune.kernels.native.write_codes import write_vectors_native


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    k_codes_ptr,
    k_scales_ptr,
    k_tensor_scale_ptr,
    v_codes_ptr,
    v_scales_ptr,
    v_tensor_scale_ptr,
    num_vectors,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_CODE: tl.constexpr,
    K_GROUP_SIZE: tl.constexpr,
    K_SCALE_DTYPE: tl.constexpr,
    K_TOKEN_GROUP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_GROUP_SIZE: tl.constexpr,
    V_SCALE_DTYPE: tl.constexpr,
    V_TOKEN_GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_R (token, head) vectors of K and of V. Grid: cdiv(N * H, BLOCK_R)."""
    vectors = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = vectors < num_vectors
    tokens = (vectors // NUM_HEADS).to(tl.int64)
    heads = vectors % NUM_HEADS
    slots = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    mask = in_range & (slots >= 0)
    dims = tl.arange(0, BLOCK_D)
    load_mask = mask[:, None] & (dims[None, :] < HEAD_DIM)
    k_offsets = tokens[:, None] * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    k = tl.load(k_ptr + k_offsets, mask=load_mask, other=0.0).to(tl.float32)
    quantize_store_tile(
        k_codes_ptr,
        k_scales_ptr,
        k_tensor_scale_ptr,
        slots,
        heads,
        mask,
        k,
        NUM_HEADS,
        HEAD_DIM,
        K_CODE,
        K_GROUP_SIZE,
        K_SCALE_DTYPE,
    )
    v_offsets = tokens[:, None] * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    v = tl.load(v_ptr + v_offsets, mask=load_mask, other=0.0).to(tl.float32)
    quantize_store_tile(
        v_codes_ptr,
        v_scales_ptr,
        v_tensor_scale_ptr,
        slots,
        heads,
        mask,
        v,
        NUM_HEADS,
        HEAD_DIM,
        V_CODE,
        V_GROUP_SIZE,
        V_SCALE_DTYPE,
    )


def _check_write(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_pool: KVPool,
    v_pool: KVPool,
) -> None:
    """Raise early if the new vectors, slots and pools disagree in shape."""
    for name, new, pool in (("k_new", k_new, k_pool), ("v_new", v_new, v_pool)):
        expected = (slot_mapping.shape[0], pool.num_heads, pool.head_dim)
        if tuple(new.shape) != expected:
            raise ValueError(f"{name}.shape={tuple(new.shape)}: expected {expected}")
    if k_pool.head_dim != v_pool.head_dim or k_pool.num_slots != v_pool.num_slots:
        raise ValueError(
            f"k_pool and v_pool: need equal head_dim and slots, got {k_pool.head_dim} / "
            f"{v_pool.head_dim} and {k_pool.num_slots} / {v_pool.num_slots}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: must be 1-D int32 or int64, got {slot_mapping.dtype}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.fmt.token_group > 1:
            raise ValueError(
                f"{name}: {pool.fmt} shares scales across tokens; it is written a whole block "
                "at a time (compress_blocks with ratio 1), never token by token"
            )


def write_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_pool: KVPool,
    v_pool: KVPool,
) -> None:
    """Quantize k_new, v_new [N, H, D] (any float dtype, unit stride along D) into the pools'
    slots slot_mapping [N] (int32/int64, negative = skip), in place."""
    _check_write(k_new, v_new, slot_mapping, k_pool, v_pool)
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    num_heads, head_dim = k_pool.num_heads, k_pool.head_dim
    num_vectors = slot_mapping.shape[0] * num_heads
    if num_vectors == 0:
        return
    programs, block_r, block_d = vector_tiles(num_vectors, head_dim)
    _write_kv_kernel[(programs,)](
        k_new,
        v_new,
        slot_mapping.contiguous(),
        k_pool.codes,
        k_pool.scales if k_pool.scales is not None else k_pool.codes,
        k_pool.tensor_scale,
        v_pool.codes,
        v_pool.scales if v_pool.scales is not None else v_pool.codes,
        v_pool.tensor_scale,
        num_vectors,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **format_switches(k_pool.fmt, "K_"),
        **format_switches(v_pool.fmt, "V_"),
        **EXACT_ARITHMETIC,
    )


def write_kv_torch(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_pool: KVPool,
    v_pool: KVPool,
) -> None:
    """`write_kv_ref`'s bits, each pool by the CPU kernel where it serves the pool's format
    (`kvtune.kernels.native.write_codes`: one call, where the reference's torch operations
    cost a decode step 0.3-0.5 ms a pool a layer), else by the reference."""
    _check_write(k_new, v_new, slot_mapping, k_pool, v_pool)
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        if not write_vectors_native(pool, slot_mapping, new):
            write_vectors_ref(pool, slot_mapping, new)


def write_kv_ref(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_pool: KVPool,
    v_pool: KVPool,
) -> None:
    """Torch reference of `write_kv` (same signature, same bits)."""
    _check_write(k_new, v_new, slot_mapping, k_pool, v_pool)
    write_vectors_ref(k_pool, slot_mapping, k_new)
    write_vectors_ref(v_pool, slot_mapping, v_new)
