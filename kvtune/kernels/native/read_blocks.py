"""The CPU kernels of `kvtune.kernels.cache.pool.read_blocks_into` for group-scaled codes and of
decode selection's index products (read_blocks.c): gather, element decode, scale and zero
point in one pass, the same bits as the torch path (products: the same sums in another order).
Vectors are decoded by pool_codes.h, the decoder every C kernel shares (pool_codes.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtune.kernels.native.build import load_kernel
from kvtune.kernels.native.pool_codes import PoolCodes, pool_codes

if TYPE_CHECKING:
    from kvtune.kernels.cache.pool import KVPool

SOURCE = Path(__file__).with_suffix(".c")
MAX_DIM = 512  # read_blocks.c's MAX_DIM: the longest index vector products take


class _ReadArgs(ctypes.Structure):
    """read_blocks.c's ReadArgs, field for field."""

    _fields_ = [
        ("pool", PoolCodes),
        ("table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("seqs", ctypes.c_int64),
        ("blocks", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_seq", ctypes.c_int64),
        ("out_head", ctypes.c_int64),
        ("out_token", ctypes.c_int64),
    ]


def _pool_args(pool: KVPool, table: torch.Tensor) -> _ReadArgs | None:
    """The arguments of a read of pool by table (int32, rows contiguous), or None where this
    kernel does not apply (it reads group-scaled codes)."""
    fields = pool_codes(pool) if pool.scales is not None else None
    if fields is None:
        return None
    seqs, blocks = table.shape
    return _ReadArgs(
        pool=fields, table=table.data_ptr(), table_stride=table.stride(0), seqs=seqs, blocks=blocks
    )


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
    pool_fields = args.pool
    expected = (args.seqs, pool_fields.heads, args.blocks * pool_fields.block_size, pool.head_dim)
    if tuple(out.shape) != expected:
        raise ValueError(f"out: shape {tuple(out.shape)} must be {expected}")
    args.out = out.data_ptr()
    args.out_seq, args.out_head, args.out_token = out.stride()[:3]
    if library.kvtune_read_blocks(ctypes.byref(args)):
        raise IndexError(f"table: block ids must be below {pool_fields.num_blocks}")
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
        or head_dim != keys.head_dim
        or head_dim > MAX_DIM
        or num_heads // keys.num_heads > MAX_QUERY_GROUP
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
        ctypes.c_int64(num_heads // keys.num_heads),
        ctypes.c_int64(length),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int64(out.stride(0)),
        ctypes.c_int64(out.stride(1)),
    )
    if failed:
        raise IndexError(f"table: block ids must be below {keys.codes.shape[0]}")
    return out
