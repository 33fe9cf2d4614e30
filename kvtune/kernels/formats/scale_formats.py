"""The dtypes a group scale can be stored in, registered once.

A symmetric group's scale is chosen by one rule (see `kvtune.kernels.formats.quantize`), in fp32:

    exact  = max(amax_g / max_code, floor)
    stored = encode(exact)            the bytes kept beside the codes
    scale  = decode(stored)           what dequantization multiplies by
    units  = x / scale, or x * fp32(1 / scale) where `reciprocal` is set

Each dtype is a record here (bytes, the SCALE constexpr the Triton helpers switch on, torch
references), so `KVFormat` (bytes), `kernels.quantize` (kernels and references) and the policy
read one table:

- fp16: the exact scale rounded to fp16 (nearest even); can also hold a zero point.
- e4m3: an E4M3 code (nearest even, saturating at 448): NVFP4's block scales.
- fp32: the exact scale itself, floored at 1e-6, and elements multiplied by its fp32
  reciprocal: vLLM's fp8_per_token_head / int8_per_token_head scales (docs/engine_formats.md).
- ue8m0: a power of two 2^e, e = ceil(log2(exact)) after a floor of 1e-10, stored as the byte
  e + 127 (the MX / OCP E8M0 scale, as SGLang's fp4_mx_block16 chooses it). The exponent is
  taken from the fp32 bit pattern, so it is exact: an engine computing log2 in floating point can
  pick the next lower exponent when amax / max_code lies within an ulp above a power of two.
  Byte 0 (2^-127) and 0xFF (NaN) are never produced (the floor keeps e >= -33).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtune.kernels.formats.fp_codes import (
    E4M3_MAX,
    decode_e4m3,
    decode_e4m3_fast,
    encode_e4m3,
    encode_e4m3_fast,
)

# SCALE constexpr values of the device helpers.
SCALE_FP16 = tl.constexpr(0)
SCALE_DTYPE = tl.constexpr(1)
SCALE_FP32 = tl.constexpr(2)
SCALE_UE8M0 = tl.constexpr(3)
UE8M0_BIAS = 127
FP32_MANTISSA_BITS = tl.constexpr(23)


@dataclass(frozen=True)
class ScaleFormat:
    """One group-scale dtype (see the module docstring for the rule).

    code: SCALE constexpr of the Triton helpers. nbytes: bytes a stored scale takes.
    torch_dtype: dtype of the scales buffer. zero_point: can also store a group zero point.
    floor: smallest exact scale (0: none). reciprocal: elements are multiplied by the fp32
    reciprocal of the scale instead of divided by it.
    encode: exact fp32 scales -> stored (torch). decode: stored -> fp32 scales (torch).
    relative_max: the largest stored scale, where the range is so narrow that group scales are
        kept relative to the stream's fp32 tensor scale, which calibration sets so that they fit
        (E4M3: 448, NVFP4's two-level scaling); None: a scale holds its group's own magnitude.
    """

    code: int
    nbytes: int
    torch_dtype: torch.dtype
    zero_point: bool
    floor: float
    reciprocal: bool
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    relative_max: float | None = None


def encode_ue8m0_ref(exact: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 scales -> UE8M0 bytes of 2^ceil(log2(exact)), through frexp:
    exact = m * 2^E with m in [0.5, 1), so ceil(log2(exact)) = E - 1 when m is 0.5, else E."""
    mantissa, exponent = torch.frexp(exact.float())
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return (ceil_log2 + UE8M0_BIAS).to(torch.uint8)


def decode_ue8m0_ref(stored: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 2^(byte - 127) (exact)."""
    ones = torch.ones(stored.shape, dtype=torch.float32, device=stored.device)
    return torch.ldexp(ones, stored.to(torch.int32) - UE8M0_BIAS)


def _to_fp16(scales: torch.Tensor) -> torch.Tensor:
    return scales.half()


def _to_fp32(scales: torch.Tensor) -> torch.Tensor:
    return scales.float()


SCALE_FORMATS: dict[str, ScaleFormat] = {
    "fp16": ScaleFormat(SCALE_FP16.value, 2, torch.float16, True, 0.0, False, _to_fp16, _to_fp32),
    "e4m3": ScaleFormat(
        SCALE_DTYPE.value,
        1,
        torch.uint8,
        False,
        0.0,
        False,
        encode_e4m3_fast,
        decode_e4m3_fast,
        relative_max=E4M3_MAX,
    ),
    "fp32": ScaleFormat(SCALE_FP32.value, 4, torch.float32, False, 1e-6, True, _to_fp32, _to_fp32),
    "ue8m0": ScaleFormat(
        SCALE_UE8M0.value, 1, torch.uint8, False, 1e-10, False, encode_ue8m0_ref, decode_ue8m0_ref
    ),
}
_BY_CODE = {fmt.code: fmt for fmt in SCALE_FORMATS.values()}


@triton.constexpr_function
def scale_floor(scale_code):
    """The floor of the exact scale of the scale dtype with this SCALE code (0.0: none)."""
    return _BY_CODE[scale_code].floor


@triton.constexpr_function
def scale_reciprocal(scale_code):
    """Whether elements are multiplied by the fp32 reciprocal of this dtype's scale."""
    return _BY_CODE[scale_code].reciprocal


@triton.jit
def encode_scale(exact, SCALE: tl.constexpr):
    """fp32 tile of exact (floored) scales -> stored scales of the SCALE dtype."""
    if SCALE == SCALE_DTYPE:
        stored = encode_e4m3(exact)
    elif SCALE == SCALE_FP32:
        stored = exact
    elif SCALE == SCALE_UE8M0:
        # ceil(log2(x)) of a positive normal x: its biased exponent, plus one unless the
        # mantissa is 0 (x a power of two). The biased exponent already carries UE8M0's 127.
        bits = exact.to(tl.int32, bitcast=True)
        mantissa = bits & 0x7FFFFF
        stored = ((bits >> FP32_MANTISSA_BITS) + (mantissa != 0).to(tl.int32)).to(tl.uint8)
    else:
        stored = exact.to(tl.float16)
    return stored


@triton.jit
def decode_scale(stored, SCALE: tl.constexpr):
    """Stored scales of the SCALE dtype -> fp32 (exact)."""
    if SCALE == SCALE_DTYPE:
        scale = decode_e4m3(stored)
    elif SCALE == SCALE_UE8M0:
        scale = (stored.to(tl.int32) << FP32_MANTISSA_BITS).to(tl.float32, bitcast=True)
    else:
        scale = stored.to(tl.float32)
    return scale
