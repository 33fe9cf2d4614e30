"""The CPU kernels of `kvtune.kernels.cache.pool.read_blocks_into` for group-scaled codes and of
decode selection's index products (read_blocks.c): gather, element decode, scale and zero
point in one pass, the same bits as the torch path (products: the same sums in another order).
Elements are decoded by a table of every byte's values, made from the format's own decode
(plain unsigned codes by arithmetic, where the table shows them to be just that); one-byte
scales likewise."""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtune.kernels.native.build import load_kernel

if TYPE_CHECKING:
    from kvtune.kernels.cache.pool import KVPool
    from kvtune.kernels.formats.kv_format import KVFormat

SOURCE = Path(__file__).with_suffix(".c")
DECODE_NIBBLES, DECODE_BYTES, DECODE_TABLE = 0, 1, 2
SCALE_KINDS = {torch.float16: 0, torch.float32: 1, torch.uint8: 2}
MAX_GROUPS = 512  # read_blocks.c's MAX_GROUPS
MAX_DIM = 512  # read_blocks.c's MAX_DIM: the longest index vector products take


class _ReadArgs(ctypes.Structure):
    """read_blocks.c's ReadArgs, field for field."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("num_blocks", ctypes.c_int64),
        ("code_block", ctypes.c_int64),
        ("code_token", ctypes.c_int64),
        ("code_head", ctypes.c_int64),
        ("table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("seqs", ctypes.c_int64),
        ("blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("decode", ctypes.c_int32),
        ("per_byte", ctypes.c_int32),
        ("decode_table", ctypes.c_void_p),
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
        ("out", ctypes.c_void_p),
        ("out_seq", ctypes.c_int64),
        ("out_head", ctypes.c_int64),
        ("out_token", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class _Tables:
    """How read_blocks.c decodes one format's elements and scales."""

    decode: int
    per_byte: int
    decode_table: torch.Tensor  # fp32 [256, per_byte]
    scale_table: torch.Tensor | None  # fp32 [256] for one-byte scales


@functools.cache
def _tables(fmt: KVFormat) -> _Tables | None:
    """The decode tables of fmt, or None when a byte does not hold whole codes."""
    bits = fmt.element.bits
    if 8 % bits:
        return None
    every_byte = torch.arange(256, dtype=torch.uint8)
    values = fmt.element.decode(every_byte[:, None]).float().contiguous()
    per_byte = 8 // bits
    if values.shape != (256, per_byte):
        return None
    unsigned = (every_byte[:, None].long() >> (torch.arange(per_byte) * bits)) & (2**bits - 1)
    decode = DECODE_TABLE
    if torch.equal(values, unsigned.float()) and bits in (4, 8):
        decode = DECODE_NIBBLES if bits == 4 else DECODE_BYTES
    scale_table = None
    if fmt.scale_torch_dtype == torch.uint8:
        scale_table = fmt.scale_format.decode(every_byte).float().contiguous()
    return _Tables(decode, per_byte, values, scale_table)


def _prepared(pool: KVPool) -> _ReadArgs | None:
    """The arguments fixed by pool (codes, scales, format), or None where this kernel does not
    apply."""
    codes, scales, fmt = pool.codes, pool.scales, pool.fmt
    if (
        scales is None
        or codes.device.type != "cpu"
        or codes.dtype != torch.uint8
        or scales.dtype not in SCALE_KINDS
    ):
        return None
    groups = fmt.scales_per_vector(pool.head_dim) // (2 if fmt.zero_point else 1)
    tables = _tables(fmt)
    if tables is None or groups > MAX_GROUPS:
        return None
    scale_bytes = scales.element_size()
    return _ReadArgs(
        codes=codes.data_ptr(),
        num_blocks=codes.shape[0],
        code_block=codes.stride(0),
        code_token=codes.stride(1),
        code_head=codes.stride(2),
        block_size=codes.shape[1],
        heads=codes.shape[2],
        head_dim=pool.head_dim,
        decode=tables.decode,
        per_byte=tables.per_byte,
        decode_table=tables.decode_table.data_ptr(),
        scales=scales.data_ptr(),
        scale_block=scales.stride(0) * scale_bytes,
        scale_row=scales.stride(1) * scale_bytes,
        scale_head=scales.stride(2) * scale_bytes,
        scale_kind=SCALE_KINDS[scales.dtype],
        scale_table=0 if tables.scale_table is None else tables.scale_table.data_ptr(),
        rows=fmt.token_group,
        groups=groups,
        zero_point=int(fmt.zero_point),
    )


# The fixed arguments of every live pool, made once (`_prepared`): a decode step reads each
# pool several times in every layer. Keyed by the pool's identity and dropped with the pool.
_fixed_args: dict[int, _ReadArgs | None] = {}


def _fixed(pool: KVPool) -> _ReadArgs | None:
    key = id(pool)
    if key not in _fixed_args:
        _fixed_args[key] = _prepared(pool)
        weakref.finalize(pool, _fixed_args.pop, key, None)
    return _fixed_args[key]


def _pool_args(pool: KVPool, table: torch.Tensor) -> _ReadArgs | None:
    """The arguments of a read of pool by table (int32, rows contiguous), or None where this
    kernel does not apply."""
    fixed = _fixed(pool)
    if fixed is None:
        return None
    args = _ReadArgs.from_buffer_copy(fixed)
    args.table, args.table_stride = table.data_ptr(), table.stride(0)
    args.seqs, args.blocks = table.shape
    args.tensor_scale = 1.0 if pool.unit_tensor_scale else float(pool.tensor_scale)
    return args


def _int32_rows(table: torch.Tensor) -> torch.Tensor:
    """table as int32 with contiguous rows, as the kernels index it."""
    if table.dtype != torch.int32 or table.stride(-1) != 1:
        return table.to(torch.int32).contiguous()
    return table


def read_blocks_native(pool: KVPool, table: torch.Tensor, out: torch.Tensor) -> bool:
    """`read_blocks_into` for a pool of group-scaled codes on the CPU (see there); False,
    having done nothing, where this kernel does not apply or is not built."""
    library = load_kernel(SOURCE)
    if (
        library is None
        or out.device.type != "cpu"
        or out.dtype != torch.float32
        or out.stride(-1) != 1
    ):
        return False
    table = _int32_rows(table)
    args = _pool_args(pool, table)
    if args is None:
        return False
    expected = (args.seqs, args.heads, args.blocks * args.block_size, args.head_dim)
    if tuple(out.shape) != expected:
        raise ValueError(f"out: shape {tuple(out.shape)} must be {expected}")
    args.out = out.data_ptr()
    args.out_seq, args.out_head, args.out_token = out.stride()[:3]
    if library.kvtune_read_blocks(ctypes.byref(args)):
        raise IndexError(f"table: block ids must be below {args.num_blocks}")
    return True


MAX_QUERY_GROUP = 16  # read_blocks.c's MAX_QUERY_GROUP


def index_products_native(
    q: torch.Tensor, keys: KVPool, bounds_low: KVPool | None, table: torch.Tensor, length: int
) -> torch.Tensor | None:
    """fp32 [S, Hq, length]: each decode query q [S, Hq, D] with the first `length` index
    vectors of its sequence's blocks (table [S, blocks], padding negative): q+ . max + q- . min
    with key bounds (keys the maxima, bounds_low the minima), else q . key. Index vectors are
    decoded and dotted in one pass, without a buffer. None, having done nothing, where this
    kernel does not apply or is not built."""
    library = load_kernel(SOURCE)
    if library is None or q.device.type != "cpu" or length == 0:
        return None
    table = _int32_rows(table)
    args = [_pool_args(pool, table) for pool in (keys, bounds_low) if pool is not None]
    seqs, num_heads, head_dim = q.shape
    if (
        any(pool_args is None for pool_args in args)
        or head_dim != args[0].head_dim
        or head_dim > MAX_DIM
        or num_heads // args[0].heads > MAX_QUERY_GROUP
    ):
        return None
    queries = q.float().contiguous()
    out = torch.empty(seqs, num_heads, length, device=q.device)
    failed = library.kvtune_index_products(
        ctypes.byref(args[0]),
        ctypes.byref(args[1]) if len(args) > 1 else None,
        ctypes.c_void_p(queries.data_ptr()),
        ctypes.c_int64(queries.stride(0)),
        ctypes.c_int64(queries.stride(1)),
        ctypes.c_int64(num_heads // args[0].heads),
        ctypes.c_int64(length),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(out.stride(0)),
        ctypes.c_int64(out.stride(1)),
    )
    if failed:
        raise IndexError(f"table: block ids must be below {args[0].num_blocks}")
    return out
