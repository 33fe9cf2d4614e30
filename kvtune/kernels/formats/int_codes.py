"""Unsigned integer codes of the asymmetric uniform formats (int8, int4, int3, int2): Triton device
functions and torch references.

A group of values is mapped onto the grid zero + c * scale, c = 0 .. 2^bits - 1 (see
`kvtune.kernels.formats.quantize` for how zero and scale are chosen). Given u = (x - zero) / scale
in fp32, the code is u clamped to [0, 2^bits - 1] and rounded to the nearest integer, ties to even.
Inputs must be finite: NaN and infinities give unspecified codes.

Packing: codes form one little-endian bit stream per vector, least significant bits first:
element i occupies bits [i * bits, (i + 1) * bits) of the vector's bytes. int8 is one code a
byte; int4 puts element 2i in the low nibble of byte i (like FP4); int2 puts element 4i in the
lowest two bits of byte i; int3 packs 8 codes into 3 bytes, element i starting at bit 3i (some
codes straddle two bytes). `pack_codes_ref` / `unpack_codes_ref` are the torch versions;
`decode_codes_fast` is the torch backend's hot path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Smallest scale of vLLM TurboQuant's value codes (a constant group still divides safely).
HALF_UP_SCALE_FLOOR = 1e-8


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


@triton.jit
def encode_uint_half_up(u, BITS: tl.constexpr):
    """fp32 tile u >= 0 (code units) -> int32 codes clamp(trunc(u + 0.5), 0, 2^BITS - 1):
    halves round up (vLLM TurboQuant's value codes)."""
    top: tl.constexpr = 2**BITS - 1
    shifted = tl.minimum(tl.maximum(u + 0.5, 0.0), top + 0.5)
    return shifted.to(tl.int32)


def encode_uint_ref(u: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 tensor u (code units) -> uint8 codes: clamp to [0, 2^bits - 1], round half to even."""
    return torch.round(u.float().clamp(0, 2**bits - 1)).to(torch.uint8)


def encode_uint_half_up_ref(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Torch reference of `encode_uint_half_up`: uint8 codes."""
    return torch.trunc(u.float() + 0.5).clamp(0, 2**bits - 1).to(torch.uint8)


def codes_per_chunk(bits: int) -> int:
    """Codes in the smallest whole number of bytes they fill exactly (8 for 3-bit codes)."""
    return 8 // math.gcd(bits, 8)


def pack_codes_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] of `bits` bits each -> bytes [..., D * bits / 8], little end first."""
    chunk = codes_per_chunk(bits)
    if codes.shape[-1] % chunk:
        raise ValueError(f"codes.shape[-1]={codes.shape[-1]}: must be a multiple of {chunk}")
    if bits == 8:
        return codes.to(torch.uint8)
    chunks = codes.to(torch.int64).unflatten(-1, (-1, chunk))
    shifts = torch.arange(chunk, device=codes.device) * bits
    words = (chunks << shifts).sum(-1)  # disjoint bit fields: the sum is their bitwise or
    byte_shifts = torch.arange(chunk * bits // 8, device=codes.device) * 8
    return ((words[..., None] >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_codes_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """bytes [..., B] -> uint8 codes [..., B * 8 / bits]; inverse of `pack_codes_ref`."""
    if bits == 8:
        return packed
    chunk = codes_per_chunk(bits)
    chunk_bytes = chunk * bits // 8
    grouped = packed.to(torch.int64).unflatten(-1, (-1, chunk_bytes))
    byte_shifts = torch.arange(chunk_bytes, device=packed.device) * 8
    words = (grouped << byte_shifts).sum(-1)
    shifts = torch.arange(chunk, device=packed.device) * bits
    return ((words[..., None] >> shifts) & (2**bits - 1)).to(torch.uint8).flatten(-2)


def decode_codes_fast(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bytes [..., B] -> fp32 codes [..., B * 8 / bits], as `unpack_codes_ref(...).float()`.
    2- and 4-bit codes by one shift and mask of the bytes per code slot, written straight into
    the fp32 result: the shifts of the 64-bit words that the reference builds took most of an
    int4 decode step on a CPU, and a 256-entry table lookup was 3x slower than this for int4."""
    if bits == 8:
        return packed.float()
    if 8 % bits:
        return unpack_codes_ref(packed, bits).float()
    per_byte, mask = 8 // bits, 2**bits - 1
    codes = torch.empty(*packed.shape, per_byte, dtype=torch.float32, device=packed.device)
    codes[..., 0] = packed & mask  # the lowest slot needs no shift, the highest no mask
    for slot in range(1, per_byte - 1):
        codes[..., slot] = (packed >> (slot * bits)) & mask
    codes[..., per_byte - 1] = packed >> ((per_byte - 1) * bits)
    return codes.view(*packed.shape[:-1], packed.shape[-1] * per_byte)
