"""Unsigned integer codes of the asymmetric uniform formats (int8, int4, int2): Triton device
functions and torch references.

A group of values is mapped onto the grid zero + c * scale, c = 0 .. 2^bits - 1 (see
`kernels.quantize` for how zero and scale are chosen). Given u = (x - zero) / scale in fp32,
the code is u clamped to [0, 2^bits - 1] and rounded to the nearest integer, ties to even.
Inputs must be finite: NaN and infinities give unspecified codes.

Packing (int4, int2): codes are packed little end first, like FP4: element i of a vector lives
in byte i // (8 / bits) at bit offset (i % (8 / bits)) * bits, so int4 puts element 2i in the
low nibble of byte i and int2 puts element 4i in the lowest two bits of byte i. int8 is one
code a byte. `pack_codes_ref` / `unpack_codes_ref` are the torch versions of that layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def encode_uint(u, BITS: tl.constexpr):
    """fp32 tile u (value in code units) -> int32 codes in [0, 2^BITS - 1], nearest, ties even.

    Rounding is done on the integer part and the exact fraction (u - floor(u) is exact in fp32
    for 0 <= u < 2^23), so it is identical on GPU and in the interpreter.
    """
    top: tl.constexpr = 2**BITS - 1
    clamped = tl.minimum(tl.maximum(u, 0.0), top)
    whole = clamped.to(tl.int32)  # truncation is floor for clamped >= 0
    fraction = clamped - whole.to(tl.float32)
    round_up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))
    return whole + round_up.to(tl.int32)


def encode_uint_ref(u: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 tensor u (code units) -> uint8 codes: clamp to [0, 2^bits - 1], round half to even."""
    return torch.round(u.float().clamp(0, 2**bits - 1)).to(torch.uint8)


def pack_codes_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] of `bits` bits each -> bytes [..., D * bits / 8], little end first."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"codes.shape[-1]={codes.shape[-1]}: must be a multiple of {per_byte}")
    if per_byte == 1:
        return codes.to(torch.uint8)
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, per_byte))
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for position in range(per_byte):
        packed |= grouped[..., position] << (position * bits)
    return packed


def unpack_codes_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """bytes [..., B] -> uint8 codes [..., B * 8 / bits]; inverse of `pack_codes_ref`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)
