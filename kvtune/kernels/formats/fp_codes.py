"""Bit-exact FP8 E4M3 and FP4 E2M1 codes: Triton device functions and torch references.

Why integer bit manipulation: Triton's `.to(tl.float8e4nv)` rounds wrongly in the interpreter
and FP4 has no Triton dtype at all, so both codes are built from the fp32 bit pattern with
integer operations, which behave identically on GPU and in the interpreter.

Encoding rounds to nearest, ties to even, and saturates: |x| above the largest code (448 for
E4M3, 6 for E2M1, infinities included) maps to that code with x's sign. A NaN input maps to
the E4M3 NaN code (0x7F, or 0xFF when its sign bit is set); E2M1 has no NaN, so a NaN input
maps to +-6 there. Signed zeros keep their sign bit.

Codes: E4M3 is one uint8 (sign bit 0x80, bias 7, 0x7F/0xFF are NaN, no infinities); E2M1 is
one nibble 0..15 held in a uint8 (sign bit 0x8, bias 1, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).

`encode_e2m1_ties_away` is a second E2M1 encoder, SGLang's (fp4_mx_block16): the nearest code
with halfway values rounded away from zero (2.5 -> 3, 5 -> 6), saturating at 6, and the sign
bit set only for x < 0 (-0.0 gives +0). It compares |x| with the midpoints of the grid, which is
exact in fp32; NaN gives code 0.

Nibble packing (FP4 storage): element 2i goes to the low nibble (bits 0-3) of byte i, element
2i+1 to the high nibble (bits 4-7); see `pack_e2m1_ref` / `unpack_e2m1_ref`.

`round_to_bf16` converts fp32 to bf16 with round-to-nearest-even from the bit pattern too: the
interpreter's own fp32 -> bf16 cast rounds ties up and drops the carry of a rounded-up
mantissa into the exponent.

The `_ref` functions are independent, readable torch versions (nearest value of a code table,
ties to the even code) used to check the device functions; the `_fast` ones are the torch
backend's hot path, checked bit for bit against the `_ref` ones.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

E4M3_NAN_CODE = 0x7F
E4M3_MAX = 448.0
E2M1_MAX = 6.0

# Triton device code may only read module globals that are constexpr.
FP32_MANTISSA_BITS = tl.constexpr(23)
FP32_BIAS = tl.constexpr(127)
FP32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _encode_minifloat(
    x,
    MANTISSA_BITS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    HAS_NAN: tl.constexpr,
):
    """fp32 tile -> int32 code of a sign/exponent/mantissa minifloat (RNE, saturating).

    MAX_BITS is the fp32 bit pattern of the largest finite magnitude; clamping the integer bit
    pattern to it saturates finite overflow, infinities and NaN alike.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    abs_bits = bits & 0x7FFFFFFF
    is_nan = abs_bits > 0x7F800000
    abs_bits = tl.minimum(abs_bits, MAX_BITS)
    exponent = abs_bits >> FP32_MANTISSA_BITS

    # Normal codes: drop the low mantissa bits with round-to-nearest-even, then rebias; a
    # rounding carry into the exponent field is the correct next binade.
    drop: tl.constexpr = FP32_MANTISSA_BITS - MANTISSA_BITS
    half_ulp_minus_one: tl.constexpr = 2 ** (drop - 1) - 1
    rounded = abs_bits + half_ulp_minus_one + ((abs_bits >> drop) & 1)
    normal = (rounded >> drop) - ((FP32_BIAS - BIAS) << MANTISSA_BITS)

    # Subnormal codes: the code is |x| / 2^(1 - BIAS - MANTISSA_BITS) rounded half to even,
    # i.e. the 24-bit significand shifted right by `shift` bits. Shifts are clamped to [1, 31]
    # (beyond 25 the result is 0 anyway) so no lane shifts by an undefined amount.
    significand = (abs_bits & 0x7FFFFF) | 0x800000
    shift = FP32_BIAS + FP32_MANTISSA_BITS + 1 - BIAS - MANTISSA_BITS - exponent
    shift = tl.minimum(tl.maximum(shift, 1), 31)
    quotient = significand >> shift
    remainder = significand - (quotient << shift)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.int32)

    min_normal_exponent: tl.constexpr = FP32_BIAS + 1 - BIAS
    magnitude = tl.where(exponent >= min_normal_exponent, normal, subnormal)
    if HAS_NAN:
        nan_code: tl.constexpr = 2 ** (EXPONENT_BITS + MANTISSA_BITS) - 1
        magnitude = tl.where(is_nan, nan_code, magnitude)
    return (sign << (EXPONENT_BITS + MANTISSA_BITS)) | magnitude


@triton.jit
def _decode_minifloat(
    code,
    MANTISSA_BITS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    HAS_NAN: tl.constexpr,
):
    """Integer code tile -> fp32 value of a sign/exponent/mantissa minifloat (exact)."""
    code = code.to(tl.int32)
    sign = (code >> (EXPONENT_BITS + MANTISSA_BITS)) & 1
    exponent = (code >> MANTISSA_BITS) & (2**EXPONENT_BITS - 1)
    mantissa = code & (2**MANTISSA_BITS - 1)
    normal_bits = ((exponent + (FP32_BIAS - BIAS)) << FP32_MANTISSA_BITS) | (
        mantissa << (FP32_MANTISSA_BITS - MANTISSA_BITS)
    )
    if HAS_NAN:
        all_ones: tl.constexpr = 2 ** (EXPONENT_BITS + MANTISSA_BITS) - 1
        normal_bits = tl.where((code & all_ones) == all_ones, FP32_QUIET_NAN_BITS, normal_bits)
    normal = normal_bits.to(tl.float32, bitcast=True)
    subnormal_step: tl.constexpr = 2.0 ** (1 - BIAS - MANTISSA_BITS)
    subnormal = mantissa.to(tl.float32) * subnormal_step
    magnitude = tl.where(exponent == 0, subnormal, normal)
    # The sign is set on the bit pattern: negation may lower to 0 - x, which loses -0.0.
    return (magnitude.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def encode_e4m3(x):
    """fp32 tile -> uint8 E4M3 codes (RNE, saturating at +-448, NaN -> 0x7F/0xFF)."""
    # 0x43E00000 is the fp32 bit pattern of 448.0.
    return _encode_minifloat(x, 3, 4, 7, 0x43E00000, True).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """uint8 E4M3 code tile -> fp32 values (0x7F/0xFF decode to NaN)."""
    return _decode_minifloat(code, 3, 4, 7, True)


@triton.jit
def encode_e2m1(x):
    """fp32 tile -> uint8 E2M1 nibbles 0..15 (RNE, saturating at +-6, NaN -> +-6)."""
    # 0x40C00000 is the fp32 bit pattern of 6.0.
    return _encode_minifloat(x, 1, 2, 1, 0x40C00000, False).to(tl.uint8)


@triton.jit
def decode_e2m1(code):
    """uint8 E2M1 nibble tile (0..15) -> fp32 values."""
    return _decode_minifloat(code, 1, 2, 1, False)


@triton.jit
def encode_e2m1_ties_away(x):
    """fp32 tile -> uint8 E2M1 nibbles, nearest with ties away from zero, saturating at +-6;
    sign bit for x < 0 only. The magnitude code is the number of midpoints of the grid
    0, 0.5, 1, 1.5, 2, 3, 4, 6 that |x| reaches."""
    magnitude = tl.abs(x)
    code = (magnitude >= 0.25).to(tl.int32) + (magnitude >= 0.75).to(tl.int32)
    code += (magnitude >= 1.25).to(tl.int32) + (magnitude >= 1.75).to(tl.int32)
    code += (magnitude >= 2.5).to(tl.int32) + (magnitude >= 3.5).to(tl.int32)
    code += (magnitude >= 5.0).to(tl.int32)
    return (code | tl.where(x < 0, 8, 0)).to(tl.uint8)


@triton.jit
def round_to_bf16(x):
    """fp32 tile -> bf16 tile, round to nearest even (NaN stays NaN, overflow gives inf)."""
    bits = x.to(tl.int32, bitcast=True)
    # Wrap-around of the add only happens for NaN patterns, which are replaced below.
    upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    upper = tl.where(x != x, 0x7FC0, upper)
    return upper.to(tl.int16).to(tl.bfloat16, bitcast=True)


def _decode_ref(
    code: torch.Tensor, mantissa_bits: int, exponent_bits: int, bias: int, has_nan: bool
) -> torch.Tensor:
    """Textbook decoding: (-1)^s * 2^(e - bias) * (1 + m / 2^M), subnormal when e == 0.

    Powers of two come from a table of exact Python floats (a device's exp2 need not be exact),
    and the sign is set as a bit: CUDA turns a NaN it converts or negates into the canonical
    positive NaN, and the sign bit is part of the code.
    """
    code = code.to(torch.int64)
    sign = (code >> (exponent_bits + mantissa_bits)) & 1
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (code & ((1 << mantissa_bits) - 1)).to(torch.float64)
    fraction = mantissa / 2**mantissa_bits
    powers = torch.tensor(
        [2.0 ** (e - bias) for e in range(1 << exponent_bits)], dtype=torch.float64
    ).to(code.device)
    normal = powers[exponent] * (1 + fraction)
    subnormal = 2.0 ** (1 - bias) * fraction
    magnitude = torch.where(exponent == 0, subnormal, normal).to(torch.float32)
    if has_nan:
        all_ones = (1 << (exponent_bits + mantissa_bits)) - 1
        magnitude = torch.where((code & all_ones) == all_ones, torch.nan, magnitude)
    return (magnitude.view(torch.int32) | (sign << 31).to(torch.int32)).view(torch.float32)


def _encode_ref(x: torch.Tensor, magnitudes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Nearest entry of the increasing table `magnitudes` (index = code), ties to the even code.

    |x| is clamped to the largest magnitude first (saturation); NaN maps to the largest code.
    Midpoints are compared in float64, where fp32 inputs and their sums are exact.
    """
    x = x.to(torch.float32)
    negative = torch.signbit(x)
    table = magnitudes.to(torch.float64)
    magnitude = x.abs().to(torch.float64).nan_to_num(nan=torch.inf).clamp(max=table[-1].item())
    upper = torch.searchsorted(table, magnitude).clamp(max=len(table) - 1)
    lower = (upper - 1).clamp(min=0)
    twice = 2 * magnitude
    midpoint = table[lower] + table[upper]
    pick_upper = (twice > midpoint) | ((twice == midpoint) & (upper % 2 == 0))
    code = torch.where(pick_upper, upper, lower)
    return (code | torch.where(negative, sign_bit, 0)).to(torch.uint8)


def decode_e4m3_ref(code: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> fp32 values (0x7F/0xFF decode to NaN)."""
    return _decode_ref(code, 3, 4, 7, True)


def decode_e2m1_ref(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 nibbles (0..15) -> fp32 values."""
    return _decode_ref(code, 1, 2, 1, False)


def encode_e4m3_ref(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E4M3 codes (RNE, saturating at +-448, NaN -> 0x7F/0xFF)."""
    magnitudes = decode_e4m3_ref(torch.arange(E4M3_NAN_CODE, device=x.device))
    codes = _encode_ref(x, magnitudes, 0x80)
    nan_code = E4M3_NAN_CODE | torch.where(torch.signbit(x), 0x80, 0)
    return torch.where(torch.isnan(x), nan_code, codes).to(torch.uint8)


def encode_e2m1_ref(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E2M1 nibbles 0..15 (RNE, saturating at +-6, NaN -> +-6)."""
    magnitudes = decode_e2m1_ref(torch.arange(8, device=x.device))
    return _encode_ref(x, magnitudes, 0x8)


def encode_e2m1_ties_away_ref(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E2M1 nibbles: nearest magnitude in the E2M1 table, ties to the
    larger one (ties away from zero), saturating at 6; sign bit for x < 0 only."""
    x = x.float()
    table = decode_e2m1_ref(torch.arange(8, device=x.device)).double()
    magnitude = x.abs().double().clamp(max=table[-1].item())
    distance = (magnitude[..., None] - table).abs()
    # argmin keeps the first of equal distances; reversing the table makes that the larger.
    code = 7 - distance.flip(-1).argmin(dim=-1)
    return (code | torch.where(x < 0, 0x8, 0)).to(torch.uint8)


def encode_e4m3_fast(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E4M3 codes through torch's float8_e4m3fn cast (RNE) after the
    saturating clamp: the torch backend's hot path, bit-identical to `encode_e4m3_ref`."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def encode_e2m1_fast(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> uint8 E2M1 nibbles by rounding within each binade of the grid
    {0, .5, 1, 1.5 | 2, 3 | 4, 6}: steps 0.5, 1, 2, rounded half to even (torch.round), which
    lands ties on the even code. Bit-identical to `encode_e2m1_ref`, several times faster."""
    x = x.float()
    magnitude = x.abs().nan_to_num(nan=E2M1_MAX).clamp(max=E2M1_MAX)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    value = torch.round(magnitude / step) * step
    # value -> code: 2v below 2, v + 2 in [2, 4), v / 2 + 4 from 4 (a rounded-up value keeps
    # its binade's formula: 2v = 4 and 2 + 2 agree at 2, 4 + 2 and 4 / 2 + 4 at 4).
    code = torch.where(value < 2, 2 * value, torch.where(value < 4, value + 2, value / 2 + 4))
    return (code.to(torch.uint8) | torch.where(torch.signbit(x), 0x8, 0)).to(torch.uint8)


def pack_e2m1_ref(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., D] (D even) -> bytes [..., D/2]; element 2i low, 2i+1 high."""
    if nibbles.shape[-1] % 2:
        raise ValueError(f"nibbles.shape[-1]={nibbles.shape[-1]}: must be even to pack")
    nibbles = nibbles.to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


@functools.cache
def _e4m3_table(device: torch.device) -> torch.Tensor:
    """fp32 [256]: the value of every E4M3 byte, through torch's float8_e4m3fn."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()


def decode_e4m3_fast(code: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> fp32 by table lookup (the oracle `decode_e4m3_ref` is tested
    against): the hot path of the torch backend. A lookup, not a float8 cast: the cast runs
    about 6x slower on a CPU, where it dominated an fp8 decode step."""
    values = _e4m3_table(code.device).index_select(0, code.reshape(-1).int())
    return values.view(code.shape)


@functools.cache
def _e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: the two values (low nibble, high nibble) of every packed E2M1 byte."""
    nibbles = unpack_e2m1_ref(torch.arange(256, dtype=torch.uint8, device=device)[:, None])
    return decode_e2m1_ref(nibbles)


def decode_packed_e2m1_fast(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., D/2] -> fp32 [..., D] by table lookup (same values as
    `decode_e2m1_ref(unpack_e2m1_ref(packed))`)."""
    table = _e2m1_pair_table(packed.device)
    values = table.index_select(0, packed.reshape(-1).int())
    return values.view(*packed.shape[:-1], packed.shape[-1] * 2)


def unpack_e2m1_ref(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., D/2] -> uint8 nibbles [..., D]; inverse of `pack_e2m1_ref`."""
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
