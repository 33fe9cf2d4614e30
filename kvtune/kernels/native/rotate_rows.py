"""The CPU kernel of the rotations' products (rotate_rows.c): `(x.double() @ matrix).float()`
in one call, summed in fp64 in a fixed order."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvtune.kernels.native.build import load_kernel

SOURCE = Path(__file__).with_suffix(".c")
MAX_DIM = 1024  # rotate_rows.c's MAX_DIM


@functools.cache
def _declared(library: ctypes.CDLL) -> ctypes._CFuncPtr:
    function = library.kvtune_rotate_rows
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    function.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def rotate_rows_native(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
    """fp32 x [..., D] @ matrix (contiguous fp64 [D, D] on the CPU, as `Rotation` keeps it),
    summed in fp64 and rounded once; None, having done nothing, where this kernel does not
    apply or is not built. Checked in few steps: a decode step rotates four times a layer."""
    library = load_kernel(SOURCE)
    dim = x.shape[-1]
    if library is None or x.device.type != "cpu" or dim > MAX_DIM:
        return None
    if matrix.dtype != torch.float64 or matrix.shape != (dim, dim) or not matrix.is_contiguous():
        raise ValueError(f"matrix: must be contiguous fp64 [{dim}, {dim}] on the CPU")
    rows = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32)
    _declared(library)(rows.data_ptr(), rows.numel() // dim, dim, matrix.data_ptr(), out.data_ptr())
    return out
