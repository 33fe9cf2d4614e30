"""int4 codes whose integer zero point hides in the fp32 scale word (vLLM's int4_per_token_head):
Triton device functions and torch references.

Per group (vLLM: one vector of a token and KV head), in fp32:

    scale = max((max - min) / 15, 1e-6)
    zp    = clamp(round_half_away(-min / scale), 0, 15)            an integer
    code  = clamp(round_half_away(x * fp32(1 / scale) + zp), 0, 15)
    word  = bits(scale) with its 4 low mantissa bits replaced by zp     (one fp32 stored)
    value = (code - zp) * scale'                          scale' = word with those bits cleared

round_half_away(v) = trunc(v + copysign(0.5, v)), the addition rounded to fp32 as the engine's
kernel does. Replacing 4 mantissa bits changes the scale by < 2^-19 of itself. The zero point
clamps at 0 and 15, so a one-signed group loses part of its range (as in vLLM). Codes pack two a
byte, element 2i in the low nibble (`kvtune.kernels.formats.int_codes`). Inputs must be finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LEVELS = 15
SCALE_FLOOR = 1e-6
ZERO_BITS_MASK = 0xF
SCALE_BITS_MASK = ~ZERO_BITS_MASK
# The same numbers as Triton constexprs (a kernel may read no other globals).
_LEVELS = tl.constexpr(LEVELS)
_SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)
_ZERO_BITS_MASK = tl.constexpr(ZERO_BITS_MASK)
_SCALE_BITS_MASK = tl.constexpr(SCALE_BITS_MASK)


@triton.jit
def _round_half_away(v):
    """fp32 tile -> fp32 tile of integers: trunc(v +- 0.5)."""
    return (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32).to(tl.float32)


@triton.jit
def zero_in_scale_parameters(low, high):
    """Group minima and maxima (fp32) -> (scale, zero point, stored word as fp32 bits)."""
    span = tl.math.div_rn(high - low, tl.full(low.shape, _LEVELS, tl.float32))
    scale = tl.maximum(span, _SCALE_FLOOR)
    zero = _round_half_away(tl.math.div_rn(-low, scale))
    zero = tl.minimum(tl.maximum(zero, 0.0), _LEVELS)
    bits = scale.to(tl.int32, bitcast=True) & _SCALE_BITS_MASK
    word = (bits | zero.to(tl.int32)).to(tl.float32, bitcast=True)
    return scale, zero, word


@triton.jit
def zero_in_scale_units(x, scale, zero):
    """x * fp32(1 / scale) + zero: values in code units, before rounding."""
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return x * inverse + zero


@triton.jit
def encode_zero_in_scale(units):
    """fp32 tile (code units, zero point added) -> int32 codes 0..15."""
    clamped = tl.minimum(tl.maximum(units, -1.0), _LEVELS + 1.0)  # int32 range; no code changes
    return tl.minimum(tl.maximum(_round_half_away(clamped), 0.0), _LEVELS).to(tl.int32)


@triton.jit
def split_scale_word(word):
    """Stored fp32 words -> (scale with the zero-point bits cleared, zero point as fp32)."""
    bits = word.to(tl.int32, bitcast=True)
    scale = (bits & _SCALE_BITS_MASK).to(tl.float32, bitcast=True)
    return scale, (bits & _ZERO_BITS_MASK).to(tl.float32)


def _round_half_away_ref(v: torch.Tensor) -> torch.Tensor:
    return torch.trunc(v + torch.where(v >= 0, 0.5, -0.5))


def zero_in_scale_parameters_ref(
    low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `zero_in_scale_parameters` (fp32 tensors)."""
    scale = ((high - low) / LEVELS).clamp(min=SCALE_FLOOR)
    zero = _round_half_away_ref(-low / scale).clamp(0, LEVELS)
    bits = scale.view(torch.int32) & SCALE_BITS_MASK
    return scale, zero, (bits | zero.to(torch.int32)).view(torch.float32)


def zero_in_scale_units_ref(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Torch reference of `zero_in_scale_units`."""
    return x * (1.0 / scale) + zero


def encode_zero_in_scale_ref(units: torch.Tensor) -> torch.Tensor:
    """Torch reference of `encode_zero_in_scale`: uint8 codes 0..15."""
    return _round_half_away_ref(units.float()).clamp(0, LEVELS).to(torch.uint8)


def split_scale_word_ref(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `split_scale_word`."""
    bits = word.contiguous().view(torch.int32)
    return (bits & SCALE_BITS_MASK).view(torch.float32), (bits & ZERO_BITS_MASK).float()
