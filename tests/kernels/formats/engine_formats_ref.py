"""Reference encoders and decoders for the serving engines' own KV-cache formats.

What this is: plain numpy re-implementations, written from a reading of vLLM 0.33.0 and SGLang
0.5.23 (their wheels' Python / Triton sources; the formats and the files they come from are
described in docs/engine_formats.md), of every `--kv-cache-dtype` storage format those engines
offer. They are oracles for tests of kvtune's own implementations, so nothing here imports
kvtune's kernels, runtime or autotune; slow and readable is the point.

Conventions shared by every function:
- `x` is a float array whose last axis is one head vector (head_dim elements) of one token and
  one KV head; leading axes are anything (tokens, heads). Encoders quantize each vector alone.
- Element codes come back as uint8 arrays (one code a byte) or packed uint8 arrays (several
  codes a byte, least significant bits first: element 2i is the low nibble of byte i).
- Scales come back in the dtype the engine stores them in (float32 arrays, or uint8 codes of
  E4M3 / UE8M0 bytes), so `nbytes` of what an encoder returns is what the engine stores.
- Arithmetic follows the engine's precision (float32 where its kernel works in float32) with
  IEEE rounding. Triton's fp32 `/` and CUDA's `rcp.approx` are not IEEE-exact, so an engine can
  differ from these references by one code where a value lies within an ulp of a rounding tie;
  tests against an engine should allow that, tests of kvtune's own copy need not.
- Inputs are finite; NaN and infinity handling is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import ml_dtypes
import numpy as np

from tests.kernels.formats import llamacpp_formats_ref as llamacpp

# --------------------------------------------------------------------------------------------
# Small floating-point element formats, built from their bit layouts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MiniFloat:
    """A sign / exponent / mantissa element format with IEEE-style subnormals.

    `max_code` is the largest finite magnitude code (sign bit clear); codes above it are NaN
    (E4M3 "fn": 0x7F) or infinity / NaN (E5M2: 0x7C and up).
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_code: int

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exp_bits + self.man_bits)

    def magnitude(self, code: int) -> float:
        """Value of a sign-less code from the bit layout (no special values)."""
        exponent = code >> self.man_bits
        mantissa = code & ((1 << self.man_bits) - 1)
        if exponent == 0:
            return mantissa / 2**self.man_bits * 2.0 ** (1 - self.bias)
        return (1 + mantissa / 2**self.man_bits) * 2.0 ** (exponent - self.bias)

    @property
    def magnitudes(self) -> np.ndarray:
        """Finite magnitudes of codes 0..max_code, ascending (float64)."""
        return np.array([self.magnitude(c) for c in range(self.max_code + 1)])

    @property
    def max_value(self) -> float:
        return self.magnitude(self.max_code)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """float64 values of codes; codes beyond max_code give NaN (E4M3) or +-inf (E5M2)."""
        codes = np.asarray(codes, dtype=np.int64)
        magnitude_code = codes & (self.sign_bit - 1)
        table = np.full(self.sign_bit, np.nan)
        table[: self.max_code + 1] = self.magnitudes
        if self.name == "e5m2":
            table[0x7C] = np.inf
        values = table[magnitude_code]
        return np.where(codes & self.sign_bit, -values, values)

    def encode(self, x: np.ndarray, ties: str = "even") -> np.ndarray:
        """Nearest code to each value, saturating at +-max_value; uint8 codes.

        ties="even" rounds a value halfway between two codes to the one with an even mantissa
        (IEEE round-to-nearest-even, what `cvt.rn.satfinite` does); ties="up" to the larger
        magnitude (what SGLang's fp4_mx_block16 threshold compare does). The sign bit is x's
        sign bit, so -0.0 keeps it.
        """
        x = np.asarray(x, dtype=np.float64)
        grid = self.magnitudes
        mag = np.minimum(np.abs(x), grid[-1])
        upper = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
        lower = np.clip(upper - 1, 0, len(grid) - 1)
        below, above = mag - grid[lower], grid[upper] - mag
        if ties == "even":
            tie_choice = np.where(lower % 2 == 0, lower, upper)
        elif ties == "up":
            tie_choice = upper
        else:
            raise ValueError(f"ties={ties!r}; allowed: 'even', 'up'")
        code = np.where(below < above, lower, np.where(above < below, upper, tie_choice))
        code = np.where(mag == grid[upper], upper, code)
        return (code | np.where(np.signbit(x), self.sign_bit, 0)).astype(np.uint8)


E2M1 = MiniFloat("e2m1", exp_bits=2, man_bits=1, bias=1, max_code=0x7)
E4M3 = MiniFloat("e4m3fn", exp_bits=4, man_bits=3, bias=7, max_code=0x7E)
E5M2 = MiniFloat("e5m2", exp_bits=5, man_bits=2, bias=15, max_code=0x7B)

UE8M0_BIAS = 127


def decode_ue8m0(codes: np.ndarray) -> np.ndarray:
    """UE8M0 (E8M0) scale bytes: 2**(code - 127); 0xFF is NaN."""
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes == 0xFF, np.nan, np.exp2(codes.astype(np.float64) - UE8M0_BIAS))


def fp32_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Round half away from zero in float32: add +-0.5, then truncate toward zero (the kernels'
    `(v + 0.5).to(int32)` idiom, including float32 rounding of the addition)."""
    v = np.asarray(v, dtype=np.float32)
    half = np.where(v >= 0, np.float32(0.5), np.float32(-0.5))
    return np.trunc(v + half).astype(np.float32)


def round_to_model_dtype(x: np.ndarray, model_dtype: str | None) -> np.ndarray:
    """Round float values to the model's activation dtype ("bfloat16", "float16") as float32."""
    if model_dtype is None:
        return np.asarray(x, dtype=np.float32)
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if model_dtype not in dtypes:
        raise ValueError(f"model_dtype={model_dtype!r}; allowed: {sorted(dtypes)} or None")
    return np.asarray(x, dtype=np.float32).astype(dtypes[model_dtype]).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Bit packing: least significant bits first
# --------------------------------------------------------------------------------------------


def pack_lsb_first(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack `bits`-wide codes along the last axis into bytes, element j at bit offset j*bits of
    a little-endian bit stream. For 4 bits: element 2i is the low nibble of byte i; for 3 bits:
    each 8 elements fill 3 bytes read as one little-endian 24-bit word."""
    codes = np.asarray(codes, dtype=np.uint8)
    if (codes.shape[-1] * bits) % 8:
        raise ValueError(f"last axis {codes.shape[-1]} x {bits} bits is not whole bytes")
    bit_planes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = bit_planes.reshape(*codes.shape[:-1], codes.shape[-1] * bits)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack_lsb_first(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of `pack_lsb_first`: `count` codes of `bits` bits from the last axis."""
    stream = np.unpackbits(np.asarray(packed, dtype=np.uint8), axis=-1, bitorder="little")
    planes = stream[..., : count * bits].reshape(*packed.shape[:-1], count, bits)
    return (planes.astype(np.uint8) << np.arange(bits, dtype=np.uint8)).sum(-1).astype(np.uint8)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    if x.shape[-1] % block:
        raise ValueError(f"head_dim {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# --------------------------------------------------------------------------------------------
# FP8 with one scale per tensor (vLLM fp8 / fp8_e4m3 / fp8_e5m2, SGLang fp8_e4m3 / fp8_e5m2)
# --------------------------------------------------------------------------------------------

FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def encode_fp8_per_tensor(x: np.ndarray, scale: float = 1.0, fmt: str = "e4m3") -> np.ndarray:
    """vLLM: code = round-to-nearest-even, saturating, of float32(x) / scale. `scale` is the
    layer's k_scale or v_scale (checkpoint value, 1.0 when the checkpoint has none)."""
    y = np.asarray(x, dtype=np.float32) / np.float32(scale)
    return FP8_FORMATS[fmt].encode(y)


def encode_fp8_per_tensor_sglang(
    x: np.ndarray, scale: float | None = None, fmt: str = "e4m3", model_dtype="bfloat16"
) -> np.ndarray:
    """SGLang: x / scale is computed in the model dtype (an in-place `div_`), so the quotient is
    rounded twice (to bf16, then to fp8); no division at all when no scale was loaded. The
    cast is torch's: E4M3 saturates, E5M2 overflows to infinity."""
    y = np.asarray(x, dtype=np.float32)
    if scale is not None:
        y = round_to_model_dtype(y / np.float32(scale), model_dtype)
    codes = FP8_FORMATS[fmt].encode(y)
    if fmt == "e5m2":
        halfway_to_inf = 61440.0  # midpoint of 57344 and the next step, 65536
        overflow = np.abs(y) >= halfway_to_inf
        codes = np.where(overflow, (codes & 0x80) | 0x7C, codes).astype(np.uint8)
    return codes


def decode_fp8_per_tensor(codes: np.ndarray, scale: float = 1.0, fmt: str = "e4m3") -> np.ndarray:
    return (FP8_FORMATS[fmt].decode(codes) * scale).astype(np.float32)


# --------------------------------------------------------------------------------------------
# vLLM int8_per_token_head / fp8_per_token_head: one float32 scale per token and KV head
# --------------------------------------------------------------------------------------------

PER_TOKEN_HEAD_SCALE_FLOOR = 1e-6
INT8_MAX = 127.0


def encode_per_token_head(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes and float32 scales of vLLM's int8_per_token_head or fp8_per_token_head.

    scale = max(amax / Q, 1e-6) with Q = 127 (int8) or 448 (fp8); the vector is multiplied by
    the float32 reciprocal of the scale; int8 rounds half away from zero and clamps to
    [-128, 127]; fp8 clamps to +-448 and rounds to nearest even. Returns (codes: int8 or uint8
    E4M3 bytes, shape of x; scales: float32, x.shape[:-1]).
    """
    if kind not in ("int8", "fp8"):
        raise ValueError(f"kind={kind!r}; allowed: 'int8', 'fp8'")
    x = np.asarray(x, dtype=np.float32)
    q_max = np.float32(INT8_MAX if kind == "int8" else E4M3.max_value)
    amax = np.abs(x).max(axis=-1)
    scale = np.maximum(amax / q_max, np.float32(PER_TOKEN_HEAD_SCALE_FLOOR)).astype(np.float32)
    y = x * (np.float32(1.0) / scale)[..., None]
    if kind == "int8":
        return np.clip(round_half_away(y), -128, 127).astype(np.int8), scale
    return E4M3.encode(np.clip(y, -q_max, q_max)), scale


def decode_per_token_head(codes: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    values = codes.astype(np.float64) if kind == "int8" else E4M3.decode(codes)
    return (values * np.asarray(scale, dtype=np.float64)[..., None]).astype(np.float32)


# --------------------------------------------------------------------------------------------
# vLLM int4_per_token_head: randomized Hadamard rotation, asymmetric int4, zero point hidden in
# the float32 scale's low mantissa bits
# --------------------------------------------------------------------------------------------

RHT_SEED = 0x9E3779B9
INT4_LEVELS = 15


def sylvester_hadamard(n: int) -> np.ndarray:
    """The n x n +-1 Hadamard matrix of Sylvester's construction (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def largest_pow2_divisor(n: int) -> int:
    return n & -n


@cache
def rht_signs(block: int) -> np.ndarray:
    """vLLM's +-1 sign vector for a Hadamard block of `block` coordinates.

    The engine draws it with torch's CPU generator (seed 0x9E3779B9, one Bernoulli(0.5) draw a
    coordinate, sign = 2 * draw - 1); only torch reproduces those bits, so torch is used here.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    draws = torch.bernoulli(torch.full((block,), 0.5), generator=generator)
    return (2.0 * draws - 1.0).numpy().astype(np.float64)


def rht(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """vLLM's single randomized Hadamard transform along the last axis, unnormalized (float64).

    Forward: H_b (signs * x) in each block of b coordinates, b the largest power-of-two divisor
    of head_dim (the whole vector when head_dim is a power of two); norms grow by sqrt(b).
    Inverse: signs * (H_b y), which returns b * x; callers divide by b.
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    b = largest_pow2_divisor(d)
    blocks = x.reshape(*x.shape[:-1], d // b, b)
    h, signs = sylvester_hadamard(b), rht_signs(b)
    out = (blocks @ h) * signs if inverse else (blocks * signs) @ h
    return out.reshape(x.shape)


def encode_int4_per_token_head(
    x: np.ndarray, model_dtype: str | None = "bfloat16"
) -> tuple[np.ndarray, np.ndarray]:
    """Packed codes and scale words of vLLM's int4_per_token_head.

    The vector is rotated (`rht`) and the rotated values are rounded to the model dtype (the
    engine casts back before quantizing). Then, in float32: scale = max((max - min) / 15, 1e-6);
    zero point zp = clamp(round_half_away(-min / scale), 0, 15); code = clamp(round_half_away(
    y * (1 / scale) + zp), 0, 15); the stored float32 scale word is the scale with its 4 low
    mantissa bits replaced by zp. Returns (packed uint8 [..., D/2], even element in the low
    nibble; scale words float32 [...]).
    """
    y = round_to_model_dtype(rht(x), model_dtype)
    y_min, y_max = y.min(axis=-1), y.max(axis=-1)
    scale = np.maximum((y_max - y_min) / np.float32(INT4_LEVELS), np.float32(1e-6))
    scale = scale.astype(np.float32)
    zero_point = np.clip(round_half_away(-y_min / scale), 0, INT4_LEVELS)
    inv_scale = (np.float32(1.0) / scale)[..., None]
    codes = np.clip(round_half_away(y * inv_scale + zero_point[..., None]), 0, INT4_LEVELS)
    word = (fp32_bits(scale) & np.uint32(0xFFFFFFF0)) | zero_point.astype(np.uint32)
    return pack_lsb_first(codes.astype(np.uint8), 4), word.view(np.float32)


def split_int4_scale_word(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale with the zero-point bits cleared, zero point 0..15) of a stored scale word."""
    bits = fp32_bits(word)
    scale = (bits & np.uint32(0xFFFFFFF0)).view(np.float32)
    return scale, (bits & np.uint32(0xF)).astype(np.float32)


def decode_int4_rotated(packed: np.ndarray, word: np.ndarray) -> np.ndarray:
    """Dequantized vector still in the rotated domain: (code - zp) * scale (float64)."""
    scale, zero_point = split_int4_scale_word(word)
    codes = unpack_lsb_first(packed, 4, packed.shape[-1] * 2).astype(np.float64)
    return (codes - zero_point[..., None]) * scale.astype(np.float64)[..., None]


def decode_int4_per_token_head(packed: np.ndarray, word: np.ndarray) -> np.ndarray:
    """Original-domain vector: inverse rotation of the rotated dequantization, divided by b."""
    rotated = decode_int4_rotated(packed, word)
    b = largest_pow2_divisor(rotated.shape[-1])
    return (rht(rotated, inverse=True) / b).astype(np.float32)


# --------------------------------------------------------------------------------------------
# NVFP4 (vLLM nvfp4 / nvfp4_4over6, SGLang nvfp4): E2M1 elements, one E4M3 scale per 16,
# one float32 global scale per layer and per K / V
# --------------------------------------------------------------------------------------------

NVFP4_BLOCK = 16


def _nvfp4_candidate(
    blocks: np.ndarray, global_scale: float, divisor: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale codes, element codes and squared error of one block-scale choice (amax/divisor)."""
    g = np.float32(global_scale)
    amax = np.abs(blocks).max(axis=-1)
    scale_codes = E4M3.encode(amax / np.float32(divisor) / g)
    block_scale = E4M3.decode(scale_codes).astype(np.float32)
    step = (block_scale * g)[..., None]
    safe_step = np.where(step > 0, step, np.float32(1.0))
    codes = np.where(step > 0, E2M1.encode(blocks / safe_step), 0).astype(np.uint8)
    restored = E2M1.decode(codes) * step.astype(np.float64)
    error = ((restored - blocks.astype(np.float64)) ** 2).sum(axis=-1)
    return scale_codes, codes, error


def encode_nvfp4(
    x: np.ndarray, global_scale: float = 1.0, four_over_six: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Packed E2M1 codes and E4M3 block-scale bytes of NVFP4.

    Per block of 16: block scale = E4M3(amax / 6 / global_scale) (nearest even, saturating);
    element code = E2M1(x / (block_scale * global_scale)) (nearest even, saturating at 6); a
    block whose scale is 0 stores zeros. Decoding multiplies code, block scale and global
    scale. With four_over_six (vLLM nvfp4_4over6), each block also tries amax / 4 and keeps
    whichever reconstruction has the smaller squared error (amax / 6 on a tie).
    Returns (packed uint8 [..., D/2]; scale bytes uint8 [..., D/16]).
    """
    blocks = _blocks(np.asarray(x, dtype=np.float32), NVFP4_BLOCK)
    scale_codes, codes, error = _nvfp4_candidate(blocks, global_scale, 6.0)
    if four_over_six:
        scale_codes4, codes4, error4 = _nvfp4_candidate(blocks, global_scale, 4.0)
        use4 = error4 < error
        scale_codes = np.where(use4, scale_codes4, scale_codes).astype(np.uint8)
        codes = np.where(use4[..., None], codes4, codes).astype(np.uint8)
    flat_codes = codes.reshape(*codes.shape[:-2], -1)
    return pack_lsb_first(flat_codes, 4), scale_codes


def decode_nvfp4(packed: np.ndarray, scale_codes: np.ndarray, global_scale: float = 1.0):
    codes = unpack_lsb_first(packed, 4, packed.shape[-1] * 2)
    values = _blocks(E2M1.decode(codes), NVFP4_BLOCK)
    scaled = values * E4M3.decode(scale_codes)[..., None] * float(np.float32(global_scale))
    return scaled.reshape(codes.shape).astype(np.float32)


# --------------------------------------------------------------------------------------------
# SGLang fp4_mx_block16: E2M1 elements, one UE8M0 (power-of-two) scale per 16, no global scale
# --------------------------------------------------------------------------------------------

FP4_MX_BLOCK = 16


def encode_fp4_mx_block16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed E2M1 codes and UE8M0 scale bytes of SGLang's fp4_mx_block16.

    Per block of 16 (float32): e = ceil(log2(max(amax / 6, 1e-10))); scale byte = e + 127;
    elements x / 2**e go to the E2M1 code whose threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)
    they reach: halfway values round up in magnitude, not to even. The sign bit is set for
    x < 0 only (-0.0 stores +0). Returns (packed uint8 [..., D/2]; scale bytes [..., D/16]).
    """
    blocks = _blocks(np.asarray(x, dtype=np.float32), FP4_MX_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(amax / np.float32(6.0), np.float32(1e-10))))
    scaled = blocks / np.exp2(exponent.astype(np.float32))[..., None]
    magnitude_codes = E2M1.encode(np.abs(scaled), ties="up")
    codes = magnitude_codes | np.where(scaled < 0, E2M1.sign_bit, 0).astype(np.uint8)
    scale_codes = (exponent + UE8M0_BIAS).astype(np.uint8)
    return pack_lsb_first(codes.reshape(*codes.shape[:-2], -1), 4), scale_codes


def decode_fp4_mx_block16(packed: np.ndarray, scale_codes: np.ndarray) -> np.ndarray:
    codes = unpack_lsb_first(packed, 4, packed.shape[-1] * 2)
    values = _blocks(E2M1.decode(codes), FP4_MX_BLOCK) * decode_ue8m0(scale_codes)[..., None]
    return values.reshape(codes.shape).astype(np.float32)


# --------------------------------------------------------------------------------------------
# SGLang mxfp8: E4M3 elements, one UE8M0 scale per 32
# --------------------------------------------------------------------------------------------

MXFP8_BLOCK = 32


def encode_mxfp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 codes and UE8M0 scale bytes of SGLang's mxfp8 KV cache (its fused store kernel).

    Per block of 32 (float32): scale byte s = clamp(ceil(log2(max(amax, 1e-30) / 448)) + 127,
    0, 254); elements x / 2**(s - 127), clamped to +-448, rounded to nearest even E4M3.
    Returns (codes uint8, shape of x; scale bytes uint8 [..., D/32]).
    """
    blocks = _blocks(np.asarray(x, dtype=np.float32), MXFP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1), np.float32(1e-30))
    biased = np.clip(np.ceil(np.log2(amax / np.float32(448.0))) + UE8M0_BIAS, 0, 254)
    descale = np.exp2((biased - UE8M0_BIAS).astype(np.float32))[..., None]
    clipped = np.clip(blocks / descale, -448.0, 448.0)
    return E4M3.encode(clipped).reshape(np.shape(x)), biased.astype(np.uint8)


def decode_mxfp8(codes: np.ndarray, scale_codes: np.ndarray) -> np.ndarray:
    values = _blocks(E4M3.decode(codes), MXFP8_BLOCK) * decode_ue8m0(scale_codes)[..., None]
    return values.reshape(codes.shape).astype(np.float32)


# --------------------------------------------------------------------------------------------
# vLLM TurboQuant: keys Hadamard-rotated, Lloyd-Max codes + fp16 norm; values uniform with fp16
# scale and zero; K and V packed into one slot per token and KV head
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurboQuantPreset:
    """key_bits 8 means FP8 (E4M3) keys, unrotated and unscaled."""

    key_bits: int
    value_bits: int
    norm_correction: bool


TURBOQUANT_PRESETS = {
    "turboquant_k8v4": TurboQuantPreset(key_bits=8, value_bits=4, norm_correction=False),
    "turboquant_4bit_nc": TurboQuantPreset(key_bits=4, value_bits=4, norm_correction=True),
    "turboquant_k3v4_nc": TurboQuantPreset(key_bits=3, value_bits=4, norm_correction=True),
    "turboquant_3bit_nc": TurboQuantPreset(key_bits=3, value_bits=3, norm_correction=True),
}
TURBOQUANT_BOUNDARY_LAYERS = 2
TQ_NORM_EPS = 1e-8
TQ_VALUE_SCALE_FLOOR = 1e-8


def _gaussian_pdf(x: float, variance: float) -> float:
    return math.exp(-x * x / (2 * variance)) / math.sqrt(2 * math.pi * variance)


def _trapezoid(f, a: float, b: float, intervals: int) -> float:
    h = (b - a) / intervals
    inner = sum(f(a + i * h) for i in range(1, intervals))
    return h * (0.5 * (f(a) + f(b)) + inner)


@cache
def lloyd_max_gaussian(
    head_dim: int, bits: int, max_iter: int = 200, tol: float = 1e-10, intervals: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max scalar quantizer for N(0, 1/head_dim), the algorithm vLLM runs at start-up.

    Start: 2**bits centroids at the cell midpoints of [-3.5 sigma, 3.5 sigma] split evenly.
    Iterate: boundaries at centroid midpoints, outer edges at +-10.5 sigma; each centroid
    becomes its cell's conditional mean, both integrals by the trapezoid rule with `intervals`
    steps per cell; stop when no centroid moves by `tol` (the last move is not applied) or
    after max_iter rounds. Returns (centroids, boundaries) as float64, ascending.
    """
    levels = 2**bits
    variance = 1.0 / head_dim
    sigma = math.sqrt(variance)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(max_iter):
        midpoints = [(centroids[i] + centroids[i + 1]) / 2 for i in range(levels - 1)]
        edges = [3 * lo, *midpoints, 3 * hi]
        moved = []
        for i in range(levels):
            a, b = edges[i], edges[i + 1]
            mass = _trapezoid(lambda t: _gaussian_pdf(t, variance), a, b, intervals)
            moment = _trapezoid(lambda t: t * _gaussian_pdf(t, variance), a, b, intervals)
            moved.append(moment / mass if mass > 1e-15 else centroids[i])
        if max(abs(moved[i] - centroids[i]) for i in range(levels)) < tol:
            break
        centroids = moved
    centroids_arr = np.array(centroids)
    return centroids_arr, (centroids_arr[:-1] + centroids_arr[1:]) / 2


def orthonormal_hadamard(d: int) -> np.ndarray:
    """TurboQuant's rotation: Sylvester Hadamard / sqrt(d), no random signs, same every layer."""
    return sylvester_hadamard(d) / math.sqrt(d)


def turboquant_key_bytes(preset: TurboQuantPreset, head_dim: int) -> int:
    if preset.key_bits == 8:
        return head_dim
    return math.ceil(head_dim * preset.key_bits / 8) + 2  # codes + fp16 norm


def turboquant_value_bytes(preset: TurboQuantPreset, head_dim: int) -> int:
    return math.ceil(head_dim * preset.value_bits / 8) + 4  # codes + fp16 scale + fp16 zero


def turboquant_slot_bytes(name: str, head_dim: int) -> int:
    """Bytes of one token's K and V for one KV head, rounded up to an even count."""
    preset = TURBOQUANT_PRESETS[name]
    size = turboquant_key_bytes(preset, head_dim) + turboquant_value_bytes(preset, head_dim)
    return size + size % 2


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """Little-endian bytes of float16 values, shape [..., 2]."""
    return np.asarray(x, dtype=np.float32).astype("<f2").view(np.uint8).reshape(*np.shape(x), 2)


def _fp16_from_bytes(pair: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pair).view("<f2")[..., 0].astype(np.float32)


def encode_turboquant_key(k: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max codes and fp16 norm of rotated unit keys (the MSE key path).

    norm = ||k||_2 (float32); y = (k / (norm + 1e-8)) @ H (H = `orthonormal_hadamard`); code =
    number of centroid midpoints <= y (midpoints of the float32 centroids, in float32).
    Returns (codes uint8, shape of k; norms as float16).
    """
    k = np.asarray(k, dtype=np.float32)
    d = k.shape[-1]
    norms = np.sqrt((k.astype(np.float64) ** 2).sum(-1)).astype(np.float32)
    unit = k / (norms + np.float32(TQ_NORM_EPS))[..., None]
    rotated = (unit.astype(np.float64) @ orthonormal_hadamard(d)).astype(np.float32)
    centroids = lloyd_max_gaussian(d, bits)[0].astype(np.float32)
    midpoints = (centroids[:-1] + centroids[1:]) / np.float32(2)
    codes = np.searchsorted(midpoints, rotated, side="right").astype(np.uint8)
    return codes, norms.astype(np.float16)


def decode_turboquant_key(
    codes: np.ndarray, norms: np.ndarray, bits: int, norm_correction: bool
) -> np.ndarray:
    """norm * c (or norm * c / ||c|| with norm correction), rotated back with H (H = H^T)."""
    d = codes.shape[-1]
    centroids = lloyd_max_gaussian(d, bits)[0].astype(np.float32).astype(np.float64)
    c = centroids[codes]
    if norm_correction:
        c = c / np.sqrt((c**2).sum(-1, keepdims=True) + 1e-16)
    rotated = c * np.asarray(norms, dtype=np.float64)[..., None]
    return (rotated @ orthonormal_hadamard(d)).astype(np.float32)


def encode_turboquant_value(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uniform asymmetric codes: scale = max((max - min) / (2**bits - 1), 1e-8); code =
    clamp(floor((v - min) / scale + 0.5), 0, 2**bits - 1). Scale and zero (= min) are stored
    as float16. Returns (codes uint8, scales float16, zeros float16)."""
    v = np.asarray(v, dtype=np.float32)
    levels = 2**bits - 1
    v_min, v_max = v.min(-1), v.max(-1)
    scale = (v_max - v_min) / np.float32(levels)
    scale = np.where(scale > TQ_VALUE_SCALE_FLOOR, scale, np.float32(TQ_VALUE_SCALE_FLOOR))
    scale = scale.astype(np.float32)
    shifted = (v - v_min[..., None]) / scale[..., None] + np.float32(0.5)
    codes = np.clip(np.trunc(shifted), 0, levels).astype(np.uint8)
    return codes, scale.astype(np.float16), v_min.astype(np.float16)


def decode_turboquant_value(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray):
    """code * fp16 scale + fp16 zero, in float32."""
    scale = np.asarray(scales, dtype=np.float32)[..., None]
    return codes.astype(np.float32) * scale + np.asarray(zeros, dtype=np.float32)[..., None]


def encode_turboquant(k: np.ndarray, v: np.ndarray, name: str) -> np.ndarray:
    """One slot per token and KV head: [key bytes | value codes | scale fp16 | zero fp16 | pad].

    Key bytes: FP8 (E4M3, unscaled) codes for k8v4; otherwise the packed Lloyd-Max codes
    followed by the fp16 norm. Multi-byte fields are little-endian; codes are packed least
    significant bits first. Returns uint8 [..., turboquant_slot_bytes(name, D)].
    """
    preset = TURBOQUANT_PRESETS[name]
    d = k.shape[-1]
    if preset.key_bits == 8:
        key_part = E4M3.encode(np.asarray(k, dtype=np.float32))
    else:
        codes, norms = encode_turboquant_key(k, preset.key_bits)
        key_part = np.concatenate(
            [pack_lsb_first(codes, preset.key_bits), _fp16_bytes(norms)], axis=-1
        )
    value_codes, scales, zeros = encode_turboquant_value(v, preset.value_bits)
    parts = [key_part, pack_lsb_first(value_codes, preset.value_bits)]
    parts += [_fp16_bytes(scales), _fp16_bytes(zeros)]
    slot = np.concatenate(parts, axis=-1)
    pad = turboquant_slot_bytes(name, d) - slot.shape[-1]
    return np.concatenate([slot, np.zeros((*slot.shape[:-1], pad), np.uint8)], axis=-1)


def decode_turboquant(slots: np.ndarray, name: str, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) as float32 from TurboQuant slots."""
    preset = TURBOQUANT_PRESETS[name]
    key_size = turboquant_key_bytes(preset, head_dim)
    key_part = slots[..., :key_size]
    if preset.key_bits == 8:
        keys = E4M3.decode(key_part).astype(np.float32)
    else:
        codes = unpack_lsb_first(key_part[..., :-2], preset.key_bits, head_dim)
        norms = _fp16_from_bytes(key_part[..., -2:])
        keys = decode_turboquant_key(codes, norms, preset.key_bits, preset.norm_correction)
    value_data = math.ceil(head_dim * preset.value_bits / 8)
    value_part = slots[..., key_size : key_size + value_data + 4]
    value_codes = unpack_lsb_first(value_part[..., :value_data], preset.value_bits, head_dim)
    scales = _fp16_from_bytes(value_part[..., value_data : value_data + 2])
    zeros = _fp16_from_bytes(value_part[..., value_data + 2 : value_data + 4])
    return keys, decode_turboquant_value(value_codes, scales, zeros)


def turboquant_skip_layers(num_layers: int, is_hybrid: bool = False) -> list[int]:
    """Layers vLLM keeps in the model dtype under any turboquant_* dtype: the first and last
    min(2, num_layers // 2) layers of a dense model, none of a hybrid (attention + Mamba /
    linear attention) model. They are added to --kv-cache-dtype-skip-layers."""
    if is_hybrid or num_layers <= 0:
        return []
    n = min(TURBOQUANT_BOUNDARY_LAYERS, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


# --------------------------------------------------------------------------------------------
# Bytes per token, per KV head, per layer (K and V together)
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token_head(engine: str, dtype: str, head_dim: int) -> int:
    """Cache bytes one token costs in one layer for one KV head, K and V together, from the
    engines' layouts (llama.cpp's: its ggml block sizes, `llamacpp_formats_ref`). Per-layer
    scalars (per-tensor and global scales) are not counted; for SGLang nvfp4 one scale layout is
    counted (it keeps two when FlashInfer prefill is paired with TRT-LLM decode, plus a dequant
    workspace shared by all layers)."""
    d = head_dim
    fp4_with_block16_scales = 2 * (d // 2 + d // 16)
    tables = {
        "vllm": {
            "auto": 4 * d,
            "bfloat16": 4 * d,
            "float16": 4 * d,
            "fp8": 2 * d,
            "fp8_e4m3": 2 * d,
            "fp8_e5m2": 2 * d,
            "fp8_per_token_head": 2 * (d + 4),
            "int8_per_token_head": 2 * (d + 4),
            "int4_per_token_head": 2 * (d // 2 + 4),
            "nvfp4": fp4_with_block16_scales,
            "nvfp4_4over6": fp4_with_block16_scales,
            **{name: turboquant_slot_bytes(name, d) for name in TURBOQUANT_PRESETS},
        },
        "sglang": {
            "auto": 4 * d,
            "bf16": 4 * d,
            "bfloat16": 4 * d,
            "fp8_e4m3": 2 * d,
            "fp8_e5m2": 2 * d,
            "mxfp8": 2 * (d + d // MXFP8_BLOCK),
            "nvfp4": fp4_with_block16_scales,
            "fp4_mx_block16": fp4_with_block16_scales,
        },
        "llamacpp": {name: 2 * llamacpp.stream_bytes(name, d) for name in llamacpp.KV_CACHE_TYPES},
    }
    if engine not in tables:
        raise ValueError(f"engine={engine!r}; allowed: {sorted(tables)}")
    if dtype not in tables[engine]:
        raise ValueError(f"{engine} kv-cache-dtype={dtype!r}; allowed: {sorted(tables[engine])}")
    return tables[engine][dtype]


def vllm_layer_kv_dtype(
    layer_index: int,
    cache_dtype: str,
    num_layers: int,
    skip_layers: tuple[str, ...] = (),
    is_sliding_window: bool = False,
    is_hybrid: bool = False,
) -> str:
    """The dtype vLLM gives one attention layer's cache: "auto" (model dtype) when the layer's
    index, or "sliding_window" for a sliding-window layer, is in --kv-cache-dtype-skip-layers,
    or when a turboquant_* dtype protects it as a boundary layer; `cache_dtype` otherwise."""
    skipped = set(skip_layers)
    if cache_dtype.startswith("turboquant_"):
        skipped |= {str(i) for i in turboquant_skip_layers(num_layers, is_hybrid)}
    if str(layer_index) in skipped or (is_sliding_window and "sliding_window" in skipped):
        return "auto"
    return cache_dtype
