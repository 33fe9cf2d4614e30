"""The CPU kernel that quantizes new keys or values into their pool (write_codes.c): the bits of
`kvtune.kernels.cache.pool.write_vectors_ref` in one call, where the reference's torch
operations cost a decode step 0.3-0.5 ms a pool a layer. Serves per-token groups of
asymmetric integer codes with fp16 scales and zero points, and of symmetric codes (E4M3, E2M1
nearest even or ties away, int8) with fp16 or fp32 scales, and llama.cpp's q8_0, q4_0, q5_0,
q4_1 and q5_1; other formats (iq4_nl, Lloyd-Max, zero-in-scale, two-scale E2M1, one-byte
scales, token-grouped scales) take the reference."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtune.kernels.formats import element_formats
from kvtune.kernels.native.build import load_kernel

if TYPE_CHECKING:
    from kvtune.kernels.cache.pool import KVPool

SOURCE = Path(__file__).with_suffix(".c")
MAX_DIM = 1024  # write_codes.c's MAX_DIM
# write_codes.c's WRITE_* of symmetric codes by the element format's CODE, and of the
# asymmetric integer families (fp16 scales only).
SYMMETRIC_KINDS = {
    element_formats.CODE_E4M3: 1,
    element_formats.CODE_E2M1: 2,
    element_formats.CODE_E2M1_TIES_AWAY: 3,
    element_formats.CODE_INT8_SYMMETRIC: 4,
}
FAMILY_KINDS = {
    element_formats.CODE_UINT: 0,
    element_formats.CODE_UINT_HALF_UP: 5,
    element_formats.CODE_Q8_0: 6,
    element_formats.CODE_GGML_SIGNED: 7,
    element_formats.CODE_GGML_MIN: 8,
}


class _WritePool(ctypes.Structure):
    """write_codes.c's WritePool, field for field."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("code_block", ctypes.c_int64),
        ("code_token", ctypes.c_int64),
        ("code_head", ctypes.c_int64),
        ("scales", ctypes.c_void_p),
        ("scale_block", ctypes.c_int64),
        ("scale_token", ctypes.c_int64),
        ("scale_head", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("kind", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("fp32_scales", ctypes.c_int32),
        ("max_code", ctypes.c_float),
        ("floor", ctypes.c_float),
        ("tensor_scale", ctypes.c_float),
    ]


def _kind(pool: KVPool) -> int | None:
    """write_codes.c's WRITE_* for pool's format, or None where the kernel does not serve it:
    on the CPU, per-token groups of the families above, with fp16 scales (fp32 ones for the
    symmetric codes)."""
    fmt, element = pool.fmt, pool.fmt.element
    if (
        not fmt.quantized
        or fmt.group_size is None
        or fmt.token_group != 1
        or pool.codes.device.type != "cpu"
        or pool.head_dim > MAX_DIM
        or pool.head_dim % 8
    ):
        return None
    if fmt.scale_torch_dtype == torch.float16 and element.family in FAMILY_KINDS:
        return FAMILY_KINDS[element.family]
    if fmt.scale_torch_dtype in (torch.float16, torch.float32):
        return SYMMETRIC_KINDS.get(element.code)
    return None


def write_vectors_native(pool: KVPool, slots: torch.Tensor, vectors: torch.Tensor) -> bool:
    """Quantize vectors [len(slots), heads, head_dim] into pool at slots (slot < 0 skips) as
    `write_vectors_ref` does, bit for bit; False, having done nothing, where the kernel does
    not serve the pool's format or is not built."""
    kind = _kind(pool)
    library = load_kernel(SOURCE) if kind is not None else None
    if library is None:
        return False
    codes, scales, fmt = pool.codes, pool.scales, pool.fmt
    scale_bytes = scales.element_size()
    rows = vectors.float().contiguous()
    slot_ids = slots.to(torch.int64).contiguous()
    args = _WritePool(
        codes=codes.data_ptr(),
        code_block=codes.stride(0),
        code_token=codes.stride(1),
        code_head=codes.stride(2),
        scales=scales.data_ptr(),
        scale_block=scales.stride(0) * scale_bytes,
        scale_token=scales.stride(1) * scale_bytes,
        scale_head=scales.stride(2) * scale_bytes,
        num_blocks=codes.shape[0],
        block_size=codes.shape[1],
        heads=codes.shape[2],
        head_dim=pool.head_dim,
        group_size=fmt.group_size,
        kind=kind,
        bits=fmt.element.bits,
        fp32_scales=int(scales.dtype == torch.float32),
        max_code=fmt.max_code,
        floor=fmt.scale_format.floor,
        tensor_scale=1.0 if pool.unit_tensor_scale else float(pool.tensor_scale),
    )
    failed = library.kvtune_write_codes(
        ctypes.byref(args),
        ctypes.c_void_p(rows.data_ptr()),
        ctypes.c_void_p(slot_ids.data_ptr()),
        ctypes.c_int64(len(slot_ids)),
    )
    if failed == 1:
        raise IndexError(f"slots: a slot lies outside the pool's {pool.num_slots} slots")
    return failed == 0
