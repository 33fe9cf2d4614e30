"""The CPU kernel of `kvtune.kernels.cache.pool.copy_blocks` with heads (copy_rows.c): every chosen
KV head's slice of a block copied as its rows of bytes in one call a tensor, the same bytes as the
torch path's gather and scatter."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtune.kernels.native.build import load_kernel

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def _declared(library: ctypes.CDLL) -> ctypes._CFuncPtr:
    function = library.kvtune_copy_head_rows
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_int64] * 3
    function.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


def copy_head_rows_native(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    read: torch.Tensor,
    write: torch.Tensor,
    heads: torch.Tensor,
) -> bool:
    """target[write[i], :, heads[i]] = source[read[i], :, heads[i]] for each (source, target)
    of pairs: contiguous [blocks, rows, heads, width] tensors of one dtype and row shape on the
    CPU, ids int64 on the CPU; False, having done nothing, where this kernel does not apply or
    is not built."""
    library = load_kernel(SOURCE)
    ids = (read, write, heads)
    if library is None or any(
        t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous() for t in ids
    ):
        return False
    for source, target in pairs:
        if (
            source.device.type != "cpu"
            or target.device.type != "cpu"
            or source.dtype != target.dtype
            or source.shape[1:] != target.shape[1:]
            or not (source.is_contiguous() and target.is_contiguous())
        ):
            return False
    copy = _declared(library)
    pointers = [t.data_ptr() for t in ids]
    for source, target in pairs:
        _, rows, num_heads, width = source.shape
        failed = copy(
            source.data_ptr(),
            source.shape[0],
            target.data_ptr(),
            target.shape[0],
            rows,
            num_heads,
            width * source.element_size(),
            *pointers,
            len(read),
        )
        if failed:
            raise IndexError("copy_blocks: a block id or head lies outside its pool")
    return True
