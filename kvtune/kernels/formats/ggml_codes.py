"""llama.cpp's quantized KV cache types (ggml's q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl): Triton
device functions and torch references that store what the pinned llama.cpp stores.

Pinned: the llama.cpp that llama-cpp-python 0.3.36 vendors (commit 0c1e570). Its CPU backend
writes a K or V row into the cache with `ggml_set_rows`, which quantizes through the type's
`from_float` (ggml-cpu/ggml-cpu.c): the reference functions of ggml-quants.c for every type but
q8_0, which has its own x86 version (ggml-cpu/arch/x86/quants.c). A ggml block holds 32
consecutive elements of a row (one head's vector has head_dim / 32 of them) and an fp16 scale d,
plus an fp16 minimum m for the _1 types. kvtune stores the same codes and the same d (and m as
the group's zero point) in its group-scale layout, group_size 32 and fp16 scales; only the byte
order differs (`kvtune.kernels.formats.ggml_blocks` converts).

Per group x_0 .. x_{n-1} (n = 32 in llama.cpp), in fp32 with IEEE rounding, h = 2^(bits - 1),
top = 2^bits - 1:

- q4_0, q5_0 (`signed`): max = the element of largest magnitude (the first one; +0 when all are
  zero), d = max / -h, id = d ? 1 / d : 0, code = min(top, trunc(x * id + (h + 0.5)));
  value = (code - h) * fp16(d). Halves round up and the largest magnitude lands on code 0.
- q4_1, q5_1 (`min`): min and max (the first of equal ones), d = (max - min) / top,
  id = d ? 1 / d : 0, code = min(top, trunc((x - min) * id + 0.5)); stored fp16(d) and
  fp16(min); value = code * fp16(d) + fp16(min). Codes come from the fp32 min, the zero point
  stored is its fp16 rounding.
- q8_0, as llama.cpp's x86 CPUs (AVX / AVX2) store it: amax = max |x|, d = amax / 127,
  id = amax ? 127 / amax : 0, code = round_half_even(x * id), one signed byte; value =
  code * fp16(d). (ggml's scalar reference, and so gguf-py, multiplies by 1 / d and rounds
  halves away from zero; ARM NEON multiplies by 1 / d and rounds halves to even: the three agree
  except within an ulp of a half.)
- iq4_nl (`quantize_row_iq4_nl_ref`: ntry = -1, no importance weights): 16 levels
  IQ4_NL_LEVELS; max as for q4_0, id = 1 / (max / -127), code = the level nearest x * id (ggml's
  best_index_int8: halfway goes up); then d = sum(w q x) / sum(w q^2) with w = x^2 and q the
  code's level, the terms (w * q) * x and (w * q) * q summed one after another in fp32 (0 when
  sum(w q^2) is 0); value = fp16(d) * level. A group with amax < 1e-15 (fp32) stores d = 0;
  llama.cpp leaves that block's codes as its stack buffer held them, kvtune stores code 8 (every
  value reads 0 either way).

A group's parameters are (stored fp16 d, the multiplier id, stored fp16 zero point, the fp32
minimum subtracted before multiplying: 0 except for the min family); the code units are
(x - minimum) * id, computed in `kvtune.kernels.formats.quantize` for every family alike, and the
encoders here turn units into codes. Codes are clamped to [0, top] (q8_0: [-128, 127]); ggml's
own arithmetic never leaves that range. Inputs must be finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a ggml block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK4_NL = 32).
GGML_BLOCK = 32
# ggml-common.h's kvalues_iq4nl.
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
Q8_0_LEVELS = 127
# ggml-quants.c's GROUP_MAX_EPS (1e-15f), as the fp32 it compares with.
GROUP_MAX_EPS = torch.tensor(1e-15, dtype=torch.float32).item()
INT8_MIN, INT8_MAX = -128, 127

# The same numbers as Triton constexprs (a kernel may read no other globals).
_GROUP_MAX_EPS = tl.constexpr(GROUP_MAX_EPS)
_Q8_0_LEVELS = tl.constexpr(Q8_0_LEVELS)
_INT8_MIN = tl.constexpr(INT8_MIN)
_INT8_MAX = tl.constexpr(INT8_MAX)


@triton.constexpr_function
def iq4_nl_level(index):
    """Level `index` of IQ4_NL_LEVELS as a Triton constexpr float."""
    return float(IQ4_NL_LEVELS[index])


@triton.jit
def _first_where(grouped, hit):
    """fp32 [R, G]: in each group of grouped [R, G, n] the element at the first position where
    hit is set, exactly (a -0.0 too); hit must be set somewhere in every group."""
    N: tl.constexpr = grouped.shape[2]
    positions = tl.arange(0, N)[None, None, :]
    first = tl.min(tl.where(hit, positions, N), axis=2)
    return tl.max(tl.where(positions == first[:, :, None], grouped, float("-inf")), axis=2)


@triton.jit
def _largest_magnitude(grouped):
    """(amax, the first element of largest magnitude, +0 when amax is 0) per group: ggml's
    `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from amax = max = 0."""
    magnitudes = tl.abs(grouped)
    amax = tl.max(magnitudes, axis=2)
    largest = _first_where(grouped, magnitudes == amax[:, :, None])
    return amax, tl.where(amax == 0.0, 0.0, largest)


@triton.jit
def _reciprocal_or_zero(d):
    """ggml's `d ? 1.0f / d : 0.0f`."""
    safe = tl.where(d == 0.0, 1.0, d)
    return tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), safe))


@triton.jit
def ggml_signed_parameters(grouped, BITS: tl.constexpr):
    """q4_0 / q5_0 parameters of groups [R, G, n]: (fp16 d, id, fp16 zero point 0, minimum 0)."""
    _, largest = _largest_magnitude(grouped)
    d = tl.math.div_rn(largest, tl.full(largest.shape, -(2.0 ** (BITS - 1)), tl.float32))
    zeros = tl.zeros(d.shape, tl.float32)
    return d.to(tl.float16), _reciprocal_or_zero(d), zeros.to(tl.float16), zeros


@triton.jit
def ggml_min_parameters(grouped, BITS: tl.constexpr):
    """q4_1 / q5_1 parameters of groups [R, G, n]: (fp16 d, id, fp16 min, fp32 min)."""
    low = _first_where(grouped, grouped == tl.min(grouped, axis=2)[:, :, None])
    high = _first_where(grouped, grouped == tl.max(grouped, axis=2)[:, :, None])
    d = tl.math.div_rn(high - low, tl.full(low.shape, 2.0**BITS - 1, tl.float32))
    return d.to(tl.float16), _reciprocal_or_zero(d), low.to(tl.float16), low


@triton.jit
def q8_0_parameters(grouped):
    """q8_0 parameters (x86) of groups [R, G, n]: (fp16 d, id = 127 / amax, fp16 0, 0)."""
    amax = tl.max(tl.abs(grouped), axis=2)
    levels = tl.full(amax.shape, _Q8_0_LEVELS, tl.float32)
    d = tl.math.div_rn(amax, levels)
    safe = tl.where(amax == 0.0, 1.0, amax)
    multiplier = tl.where(amax == 0.0, 0.0, tl.math.div_rn(levels, safe))
    zeros = tl.zeros(d.shape, tl.float32)
    return d.to(tl.float16), multiplier, zeros.to(tl.float16), zeros


@triton.jit
def _sum_in_order(terms):
    """fp32 [R, G]: each group's terms [R, G, n] added one after another from the first (C's
    `sum += term` loop; picking a term out by a sum with zeros is exact)."""
    N: tl.constexpr = terms.shape[2]
    positions = tl.arange(0, N)[None, None, :]
    total = tl.zeros((terms.shape[0], terms.shape[1]), tl.float32)
    for j in tl.static_range(N):
        total += tl.sum(tl.where(positions == j, terms, 0.0), axis=2)
    return total


@triton.jit
def iq4_nl_parameters(grouped):
    """iq4_nl parameters of groups [R, G, n]: (fp16 least-squares d, id, fp16 0, 0)."""
    amax, largest = _largest_magnitude(grouped)
    live = amax >= _GROUP_MAX_EPS
    first_scale = tl.math.div_rn(largest, tl.full(amax.shape, iq4_nl_level(0), tl.float32))
    multiplier = tl.where(live, _reciprocal_or_zero(first_scale), 0.0)
    levels = decode_iq4_nl(encode_iq4_nl(grouped * multiplier[:, :, None]))
    weighted = (grouped * grouped) * levels
    sum_qx = _sum_in_order(weighted * grouped)
    sum_q2 = _sum_in_order(weighted * levels)
    safe = tl.where(sum_q2 > 0.0, sum_q2, 1.0)
    d = tl.where(live & (sum_q2 > 0.0), tl.math.div_rn(sum_qx, safe), 0.0)
    zeros = tl.zeros(d.shape, tl.float32)
    return d.to(tl.float16), multiplier, zeros.to(tl.float16), zeros


@triton.jit
def encode_ggml_signed(units, BITS: tl.constexpr):
    """fp32 units x * id -> int32 codes min(top, trunc(units + h + 0.5)) (q4_0, q5_0)."""
    shifted = units + (2.0 ** (BITS - 1) + 0.5)
    return tl.minimum(tl.maximum(shifted, 0.0), 2.0**BITS - 1).to(tl.int32)


@triton.jit
def encode_ggml_min(units, BITS: tl.constexpr):
    """fp32 units (x - min) * id -> int32 codes min(top, trunc(units + 0.5)) (q4_1, q5_1)."""
    return tl.minimum(tl.maximum(units + 0.5, 0.0), 2.0**BITS - 1).to(tl.int32)


@triton.jit
def encode_q8_0(units):
    """fp32 units x * id -> int32 code bytes (two's complement) of round_half_even(units)."""
    clamped = tl.minimum(tl.maximum(units, _INT8_MIN - 1.0), _INT8_MAX + 1.0)
    whole = tl.floor(clamped)
    fraction = clamped - whole  # exact below 2^23
    odd = (whole.to(tl.int32) & 1) == 1
    rounded = whole.to(tl.int32) + ((fraction > 0.5) | ((fraction == 0.5) & odd)).to(tl.int32)
    return tl.minimum(tl.maximum(rounded, _INT8_MIN), _INT8_MAX) & 0xFF


@triton.jit
def encode_iq4_nl(units):
    """fp32 units -> int32 index of the nearest level (ggml's best_index_int8: the levels at or
    below a value count it up; halfway between two levels goes to the upper)."""
    below = tl.zeros(units.shape, tl.int32)
    lower = tl.full(units.shape, iq4_nl_level(0), tl.float32)
    upper = tl.full(units.shape, iq4_nl_level(15), tl.float32)
    for index in tl.static_range(1, 16):
        at_or_below = units >= iq4_nl_level(index)
        below += at_or_below.to(tl.int32)
        lower = tl.where(at_or_below, iq4_nl_level(index), lower)
    for index in tl.static_range(14, 0, -1):
        upper = tl.where(units < iq4_nl_level(index), iq4_nl_level(index), upper)
    step_up = ~((units - lower) < (upper - units)) & (below < 15)
    return below + step_up.to(tl.int32)


@triton.jit
def decode_ggml_signed(codes, BITS: tl.constexpr):
    """Codes -> fp32 code - h (q4_0, q5_0)."""
    return (codes.to(tl.int32) - 2 ** (BITS - 1)).to(tl.float32)


@triton.jit
def decode_iq4_nl(codes):
    """Codes -> fp32 levels."""
    values = tl.zeros(codes.shape, tl.float32)
    for index in tl.static_range(16):
        values = tl.where(codes == index, iq4_nl_level(index), values)
    return values


# Torch references (same arithmetic, readable), on groups [..., G, n] or values [..., D].


def _first_where_ref(grouped: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """Torch reference of `_first_where` (argmax gives the first of equal maxima)."""
    first = hit.to(torch.int8).argmax(dim=-1, keepdim=True)
    return grouped.gather(-1, first).squeeze(-1)


def _largest_magnitude_ref(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    magnitudes = grouped.abs()
    amax = magnitudes.amax(dim=-1)
    largest = _first_where_ref(grouped, magnitudes == amax[..., None])
    return amax, torch.where(amax == 0, 0.0, largest)


def _quotient_ref(numerator: float, d: torch.Tensor) -> torch.Tensor:
    """numerator / d, one IEEE division (torch's `number / tensor` multiplies by a reciprocal,
    rounding twice); 0 where d is 0."""
    safe = torch.where(d == 0, 1.0, d)
    return torch.where(d == 0, 0.0, torch.full_like(d, numerator) / safe)


def _reciprocal_or_zero_ref(d: torch.Tensor) -> torch.Tensor:
    return _quotient_ref(1.0, d)


Parameters = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def ggml_signed_parameters_ref(grouped: torch.Tensor, bits: int) -> Parameters:
    """(fp32 d, id, None): q4_0 / q5_0 (stored: fp16(d))."""
    _, largest = _largest_magnitude_ref(grouped)
    d = largest / -(2.0 ** (bits - 1))
    return d, _reciprocal_or_zero_ref(d), None


def ggml_min_parameters_ref(grouped: torch.Tensor, bits: int) -> Parameters:
    """(fp32 d, id, fp32 min): q4_1 / q5_1 (stored: fp16(d), fp16(min))."""
    low = _first_where_ref(grouped, grouped == grouped.amin(dim=-1, keepdim=True))
    high = _first_where_ref(grouped, grouped == grouped.amax(dim=-1, keepdim=True))
    d = (high - low) / (2.0**bits - 1)
    return d, _reciprocal_or_zero_ref(d), low


def q8_0_parameters_ref(grouped: torch.Tensor) -> Parameters:
    """(fp32 d, id = 127 / amax, None): q8_0 as llama.cpp's x86 CPUs compute it."""
    amax = grouped.abs().amax(dim=-1)
    return amax / Q8_0_LEVELS, _quotient_ref(Q8_0_LEVELS, amax), None


def iq4_nl_parameters_ref(grouped: torch.Tensor) -> Parameters:
    """(fp32 least-squares d, id, None): iq4_nl (module docstring)."""
    amax, largest = _largest_magnitude_ref(grouped)
    live = amax >= GROUP_MAX_EPS
    multiplier = torch.where(live, _reciprocal_or_zero_ref(largest / IQ4_NL_LEVELS[0]), 0.0)
    levels = decode_iq4_nl_ref(encode_iq4_nl_ref(grouped * multiplier[..., None]))
    weighted = (grouped * grouped) * levels
    sum_qx, sum_q2 = (_sum_in_order_ref(weighted * factor) for factor in (grouped, levels))
    d = torch.where(live & (sum_q2 > 0), sum_qx / torch.where(sum_q2 > 0, sum_q2, 1.0), 0.0)
    return d, multiplier, None


def _sum_in_order_ref(terms: torch.Tensor) -> torch.Tensor:
    """fp32 sums of terms [..., n] over the last dim, one term after another."""
    total = torch.zeros(terms.shape[:-1], dtype=torch.float32, device=terms.device)
    for j in range(terms.shape[-1]):
        total = total + terms[..., j]
    return total


def encode_ggml_signed_ref(units: torch.Tensor, bits: int) -> torch.Tensor:
    """Torch reference of `encode_ggml_signed`: uint8 codes."""
    shifted = units.float() + (2.0 ** (bits - 1) + 0.5)
    return torch.trunc(shifted).clamp(0, 2**bits - 1).to(torch.uint8)


def encode_ggml_min_ref(units: torch.Tensor, bits: int) -> torch.Tensor:
    """Torch reference of `encode_ggml_min`: uint8 codes."""
    return torch.trunc(units.float() + 0.5).clamp(0, 2**bits - 1).to(torch.uint8)


def encode_q8_0_ref(units: torch.Tensor) -> torch.Tensor:
    """Torch reference of `encode_q8_0`: uint8 bytes of the int8 codes."""
    codes = torch.round(units.float()).clamp(INT8_MIN, INT8_MAX)
    return codes.to(torch.int8).view(torch.uint8)


def decode_q8_0_ref(stored: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of int8 codes -> fp32 codes."""
    return stored.view(torch.int8).float()


def encode_iq4_nl_ref(units: torch.Tensor) -> torch.Tensor:
    """Torch reference of `encode_iq4_nl`: uint8 level indices."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=units.device)
    units = units.float()
    below = (units[..., None] >= levels[1:]).sum(-1)
    lower = levels[below]
    upper = levels[(below + 1).clamp(max=15)]
    step_up = ~((units - lower) < (upper - units)) & (below < 15)
    return (below + step_up.long()).to(torch.uint8)


def decode_iq4_nl_ref(codes: torch.Tensor) -> torch.Tensor:
    """Level indices -> fp32 levels."""
    levels = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32, device=codes.device)
    return levels[codes.long()]
