"""Signed integer codes of the symmetric int8 format (vLLM's int8_per_token_head): Triton
device functions and torch references.

Given y = x / scale in code units (fp32), the code is y rounded half away from zero the way
vLLM's kernel does it, trunc(y + copysign(0.5, y)) with the addition rounded to fp32, clamped
to [-128, 127], stored as the byte of its two's complement. Inputs must be finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT8_MIN, INT8_MAX = -128, 127


@triton.jit
def encode_int8_symmetric(y):
    """fp32 tile (code units) -> int32 tile of the code bytes 0..255 (two's complement)."""
    # Clamping first keeps the int32 conversion in range; it changes no code.
    clamped = tl.minimum(tl.maximum(y, -129.0), 128.0)
    rounded = (clamped + tl.where(clamped >= 0, 0.5, -0.5)).to(tl.int32)  # truncates
    return tl.minimum(tl.maximum(rounded, INT8_MIN), INT8_MAX) & 0xFF


@triton.jit
def decode_int8_symmetric(code):
    """uint8 code tile -> fp32 values -128..127."""
    return code.to(tl.int8, bitcast=True).to(tl.float32)


def encode_int8_symmetric_ref(y: torch.Tensor) -> torch.Tensor:
    """fp32 tensor (code units) -> uint8 bytes of the int8 codes (round half away, clamp)."""
    y = y.float()
    half = torch.where(y >= 0, 0.5, -0.5)
    codes = torch.trunc(y + half).clamp(INT8_MIN, INT8_MAX)
    return codes.to(torch.int8).view(torch.uint8)


def decode_int8_symmetric_ref(codes: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of int8 codes -> fp32 values."""
    return codes.view(torch.int8).float()
