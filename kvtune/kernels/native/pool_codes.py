"""A KVPool as the C kernels read it (pool_codes.h's PoolCodes): codes, scales, strides and how
its elements and scales decode.

An element format is decoded by arithmetic where that gives the format's own values (fp8 E4M3,
E2M1, plain unsigned or signed codes: vectorized), else by a table of every byte's values made
from the format's decode; codes that cross byte boundaries (3 and 5 bits) by a table of every
code's value. Which arithmetic serves a format is not listed here: each candidate
decode of the C header is run on every byte and kept only where it equals the format's decode
bit for bit, so a new format takes the table until an arithmetic decode proves equal to it.
One-byte scales decode by a table likewise."""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtune.kernels.formats.int_codes import pack_codes_ref
from kvtune.kernels.native.build import load_kernel

if TYPE_CHECKING:
    from kvtune.kernels.cache.pool import KVPool
    from kvtune.kernels.formats.kv_format import KVFormat

SOURCE = Path(__file__).with_suffix(".c")
# pool_codes.h's DECODE_* and SCALE_*.
DECODE_NIBBLES, DECODE_BYTES, DECODE_TABLE, DECODE_SIGNED_BYTES = 0, 1, 2, 3
DECODE_E4M3, DECODE_E2M1 = 4, 5
DECODE_PACKED = 9
UNQUANTIZED_DECODES = {torch.float16: 6, torch.bfloat16: 7, torch.float32: 8}
# Arithmetic decodes worth trying for codes of each width, fastest first.
ARITHMETIC_DECODES = {
    4: (DECODE_NIBBLES, DECODE_E2M1),
    8: (DECODE_BYTES, DECODE_SIGNED_BYTES, DECODE_E4M3),
}
SCALE_KINDS = {torch.float16: 0, torch.float32: 1, torch.uint8: 2}
MAX_GROUPS = 512  # pool_codes.h's MAX_GROUPS
CODE_TABLE_SIZE = 32  # pool_codes.h's code_table: every 5-bit code


class PoolCodes(ctypes.Structure):
    """pool_codes.h's PoolCodes, field for field."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("code_block", ctypes.c_int64),
        ("code_token", ctypes.c_int64),
        ("code_head", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("decode", ctypes.c_int32),
        ("per_byte", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("decode_table", ctypes.c_void_p),
        ("code_table", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("scale_block", ctypes.c_int64),
        ("scale_row", ctypes.c_int64),
        ("scale_head", ctypes.c_int64),
        ("scale_kind", ctypes.c_int32),
        ("scale_table", ctypes.c_void_p),
        ("rows", ctypes.c_int32),
        ("groups", ctypes.c_int32),
        ("zero_point", ctypes.c_int32),
        ("tensor_scale", ctypes.c_float),
    ]


@dataclass(frozen=True)
class _Tables:
    """How the C kernels decode one format's elements and scales."""

    decode: int
    per_byte: int
    decode_table: torch.Tensor  # fp32 [256, per_byte], or the code table for DECODE_PACKED
    scale_table: torch.Tensor | None  # fp32 [256] for one-byte scales
    code_table: torch.Tensor | None  # fp32 [CODE_TABLE_SIZE] for codes of 2 to 5 bits


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other is NaN (a code may stand for NaN)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _arithmetic_decode(values: torch.Tensor, bits: int) -> int:
    """The first of the C header's arithmetic decodes for `bits`-bit codes that gives values
    ([256, per_byte]: the format's decode of every byte), else DECODE_TABLE."""
    library = load_kernel(SOURCE)
    if library is None:
        return DECODE_TABLE
    every_byte = torch.arange(256, dtype=torch.uint8)
    for decode in ARITHMETIC_DECODES.get(bits, ()):
        probe = PoolCodes(head_dim=values.numel(), decode=decode)
        decoded = torch.empty(values.numel())
        library.kvtune_decode_elements(
            ctypes.byref(probe),
            ctypes.c_void_p(every_byte.data_ptr()),
            ctypes.c_void_p(decoded.data_ptr()),
        )
        if _same_values(decoded.view(values.shape), values):
            return decode
    return DECODE_TABLE


def _code_table(fmt: KVFormat) -> torch.Tensor | None:
    """The value of every code of a format whose codes take 2 to 5 bits (pool_codes.h's vector
    decode of such codes), zeros after them; None for other widths."""
    bits = fmt.element.bits
    if not 2 <= bits <= 5:
        return None
    count = 2**bits
    every_code = (torch.arange(max(count, 8)) % count).to(torch.uint8)  # whole chunks
    values = fmt.element.decode(pack_codes_ref(every_code[None], bits))[0, :count]
    table = torch.zeros(CODE_TABLE_SIZE)
    table[:count] = values.float()
    return table


@functools.cache
def _tables(fmt: KVFormat) -> _Tables | None:
    """The decode tables of a quantized fmt, or None where its codes are not the C header's
    layouts (whole codes in a byte, or eight codes in `bits` bytes)."""
    bits = fmt.element.bits
    every_byte = torch.arange(256, dtype=torch.uint8)
    scale_table = None
    if fmt.scale_torch_dtype == torch.uint8:
        scale_table = fmt.scale_format.decode(every_byte).float().contiguous()
    if 8 % bits:  # codes across byte boundaries: the value of every code is the whole table
        code_table = _code_table(fmt)
        if code_table is None:
            return None
        return _Tables(DECODE_PACKED, 0, code_table, scale_table, code_table)
    values = fmt.element.decode(every_byte[:, None]).float().contiguous()
    per_byte = 8 // bits
    if values.shape != (256, per_byte):
        return None
    decode = _arithmetic_decode(values, bits)
    return _Tables(decode, per_byte, values, scale_table, _code_table(fmt))


def _prepared(pool: KVPool) -> PoolCodes | None:
    """The fields fixed by pool (codes, scales, format), or None where the C decoder does not
    apply: off the CPU, and for quantized formats only a value that is code x group scale
    (+ zero point) (x tensor scale)."""
    codes, scales, fmt = pool.codes, pool.scales, pool.fmt
    if codes.device.type != "cpu":
        return None
    fields = dict(
        codes=codes.data_ptr(),
        num_blocks=codes.shape[0],
        code_block=codes.stride(0) * codes.element_size(),
        code_token=codes.stride(1) * codes.element_size(),
        code_head=codes.stride(2) * codes.element_size(),
        block_size=codes.shape[1],
        heads=codes.shape[2],
        head_dim=pool.head_dim,
        rows=fmt.token_group,
    )
    if not fmt.quantized:
        decode = UNQUANTIZED_DECODES.get(codes.dtype)
        return None if decode is None else PoolCodes(decode=decode, **fields)
    tables = _tables(fmt)
    if tables is None or not fmt.element.affine_decode or codes.dtype != torch.uint8:
        return None
    fields.update(
        decode=tables.decode,
        per_byte=tables.per_byte,
        bits=fmt.element.bits,
        decode_table=tables.decode_table.data_ptr(),
        code_table=0 if tables.code_table is None else tables.code_table.data_ptr(),
    )
    if scales is None:  # one tensor scale, no group scales
        return PoolCodes(**fields)
    groups = fmt.scales_per_vector(pool.head_dim) // (2 if fmt.zero_point else 1)
    if scales.dtype not in SCALE_KINDS or groups > MAX_GROUPS:
        return None
    scale_bytes = scales.element_size()
    return PoolCodes(
        scales=scales.data_ptr(),
        scale_block=scales.stride(0) * scale_bytes,
        scale_row=scales.stride(1) * scale_bytes,
        scale_head=scales.stride(2) * scale_bytes,
        scale_kind=SCALE_KINDS[scales.dtype],
        scale_table=0 if tables.scale_table is None else tables.scale_table.data_ptr(),
        groups=groups,
        zero_point=int(fmt.zero_point),
        **fields,
    )


# The fixed fields of every live pool, made once (`_prepared`): a decode step reads each pool
# in every layer. Keyed by the pool's identity and dropped with the pool.
_fixed_fields: dict[int, PoolCodes | None] = {}


def pool_codes(pool: KVPool) -> PoolCodes | None:
    """pool as the C kernels read it, its tensor scale as it is now, or None where the C
    decoder does not apply (see `_prepared`)."""
    key = id(pool)
    if key not in _fixed_fields:
        _fixed_fields[key] = _prepared(pool)
        weakref.finalize(pool, _fixed_fields.pop, key, None)
    fixed = _fixed_fields[key]
    if fixed is None:
        return None
    fields = PoolCodes.from_buffer_copy(fixed)
    quantized = pool.fmt.quantized and not pool.unit_tensor_scale
    fields.tensor_scale = float(pool.tensor_scale) if quantized else 1.0
    return fields
