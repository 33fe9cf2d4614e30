"""Per-group quantization of K/V vectors to a `KVFormat`: Triton device helpers, launchers and
torch references.

One rule for every symmetric format (E4M3, E2M1 and symmetric int8 codes), in "tensor-scaled
units" x_t = x / tensor_scale:

    group scale s_g = decode(encode(max(amax_g(|x_t|) / max_code, floor)))   (scale dtype)
    code            = encode(x_t / s_g), or encode(x_t * fp32(1 / s_g))     (0 when s_g == 0)
    value           = (decode(code) * s_g) * tensor_scale

(fp4_4over6 also forms s_g from amax_g / 4 and keeps, per group, the scale whose E2M1 codes
reconstruct x_t with the smaller sum of squared errors, computed in fp64; amax_g / 6 on a tie)

where the scale dtype (`kvtune.kernels.formats.scale_formats`: fp16, E4M3, fp32, UE8M0) sets the
floor, the rounding of the scale and whether elements are multiplied by its reciprocal (fp32, as
vLLM's per-token-head kernels do),

and one for the asymmetric uniform formats (int8, int4, ...; max_code = 2^bits - 1, fp16 only):

    zero point z_g  = fp16(min_g(x_t))
    group scale s_g = fp16(max(max_g(x_t) - z_g, 0) / max_code)
    code            = round_half_even(clamp((x_t - z_g) / s_g, 0, max_code))   (0 when s_g == 0)
    value           = (code * s_g + z_g) * tensor_scale

code * s_g is exact in fp32 (at most 8 + 11 significant bits), so a fused multiply-add and a
separate multiply and add give the same bits. Elements below z_g (min rounded up to fp16) land on
code 0; the error of every element in [z_g, z_g + max_code * s_g] is at most s_g / 2.

llama.cpp's cache types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; `ggml_block` in the registry)
follow ggml's own arithmetic instead (`kvtune.kernels.formats.ggml_codes`): the group's fp32 d,
minimum and multiplier id come from the group (d = max / -8 for q4_0, ...), the code units are
(x_t - minimum) * id, the stored scale is fp16(d) and the zero point fp16(minimum); a value reads
back as code value * scale (+ zero point) like any other format.

group_size None (per tensor) stores no group scales (s_g = 1): code = encode(x / tensor_scale).
tensor_scale is an fp32 one-element tensor chosen by the caller (calibrated by the runtime); 1
leaves x unchanged, which is the classic fp16-group-scale scheme. With e4m3 scales this is
NVFP4: E4M3 group scales times an fp32 tensor scale. Unquantized formats (fp32/fp16/bf16) are
a plain cast. All divisions are IEEE round-to-nearest so that kernel and reference agree bit
for bit.

Limit: a group scale below its dtype's normal range (fp16: amax_g / max_code < 2^-14, so amax_g
< 0.027 for fp8 and < 3.7e-4 for fp4 at tensor_scale 1; E4M3: < 2^-6) keeps few significant
bits, so such groups only promise an error below their amax. A tensor_scale < 1 moves the range.
The integer formats need finite inputs with min, max and max - min within fp16 range.

Device helpers for other kernels (cache writes, attention, compression) address a vector by
(row, head) in a [rows, NUM_HEADS, width] buffer, which is how a paged pool
[num_blocks, block_size, heads, width] looks with row = block_id * block_size + offset:

    values = load_dequant_tile(codes_ptr, scales_ptr, tensor_scale_ptr, rows, head, mask, dims,
                               NUM_HEADS, HEAD_DIM, CODE, GROUP_SIZE, SCALE_DTYPE)
    quantize_store_tile(codes_ptr, scales_ptr, tensor_scale_ptr, rows, head, mask, values,
                        NUM_HEADS, HEAD_DIM, CODE, GROUP_SIZE, SCALE_DTYPE)

`format_switches(fmt)` gives the CODE / GROUP_SIZE / SCALE_DTYPE / TOKEN_GROUP constexprs of a
format. SCALE_DTYPE carries the scale dtype's SCALE code (`kvtune.kernels.formats.scale_formats`: 0
fp16, 1 e4m3, 2 fp32, 3 ue8m0); it keeps the name it had when e4m3 was the only alternative, so the
kernels that pass it through need no change. A format with a zero point keeps it in the scales
buffer, after the vector's group scales, so the helpers need no extra pointer.

Where a format plugs in: the CODE switches of `load_dequant_tile`, `_group_parameters`,
`_store_codes` and `_to_code_units`, with their torch references `quantize_groups_ref` (and
`_ggml_groups_ref`) and `dequantize_ref`, are the one place the kernels name code families (the
CODE constants of `kvtune.kernels.formats.element_formats`). A format of a new family adds its
branch to each, calling the Triton helpers and references of its own codes module; another bit
width of an existing family (CODE_UINT, CODE_UINT_HALF_UP, CODE_LLOYD, CODE_GGML_SIGNED or
CODE_GGML_MIN + bits) adds none. Every other
property a kernel needs (bits, max_code, zero_point, ...) is read from the registry entry
through `code_property`.

Token-grouped formats (TOKEN_GROUP > 1, e.g. per-channel key scales over a block) share one row
of scales among TOKEN_GROUP consecutive rows: a group is the group_size elements of a channel
group across those rows, its scale and zero point follow the same rules over all of them, and
`quantize_store_token_groups` writes whole groups at once (`quantize_store_tile` writes
per-token formats only). Reading needs only the scale row: row // TOKEN_GROUP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtune.kernels.formats import element_formats
from kvtune.kernels.formats.element_formats import code_property
from kvtune.kernels.formats.fp_codes import (
    decode_e2m1,
    decode_e2m1_ref,
    decode_e4m3,
    encode_e2m1,
    encode_e2m1_fast,
    encode_e2m1_ties_away,
    encode_e4m3,
    round_to_bf16,
)
from kvtune.kernels.formats.ggml_codes import (
    decode_ggml_signed,
    decode_iq4_nl,
    encode_ggml_min,
    encode_ggml_signed,
    encode_iq4_nl,
    encode_q8_0,
    ggml_min_parameters,
    ggml_min_parameters_ref,
    ggml_signed_parameters,
    ggml_signed_parameters_ref,
    iq4_nl_parameters,
    iq4_nl_parameters_ref,
    q8_0_parameters,
    q8_0_parameters_ref,
)
from kvtune.kernels.formats.int_codes import HALF_UP_SCALE_FLOOR, encode_uint, encode_uint_half_up
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.lloyd_max import NORM_EPS, decode_lloyd, decode_lloyd_ref, encode_lloyd
from kvtune.kernels.formats.scale_formats import (
    decode_scale,
    encode_scale,
    scale_floor,
    scale_reciprocal,
)
from kvtune.kernels.formats.symmetric_int_codes import decode_int8_symmetric, encode_int8_symmetric
from kvtune.kernels.formats.zero_in_scale_codes import (
    encode_zero_in_scale,
    split_scale_word,
    split_scale_word_ref,
    zero_in_scale_parameters,
    zero_in_scale_parameters_ref,
    zero_in_scale_units,
    zero_in_scale_units_ref,
)

# Element code kinds, the CODE constexpr of the device helpers (families: family CODE + bits).
CODE_FLOAT = tl.constexpr(element_formats.CODE_FLOAT)
CODE_E4M3 = tl.constexpr(element_formats.CODE_E4M3)
CODE_E2M1 = tl.constexpr(element_formats.CODE_E2M1)
CODE_E2M1_TIES_AWAY = tl.constexpr(element_formats.CODE_E2M1_TIES_AWAY)
CODE_E2M1_4OVER6 = tl.constexpr(element_formats.CODE_E2M1_4OVER6)
CODE_INT4_ZERO_IN_SCALE = tl.constexpr(element_formats.CODE_INT4_ZERO_IN_SCALE)
CODE_INT8_SYMMETRIC = tl.constexpr(element_formats.CODE_INT8_SYMMETRIC)
CODE_UINT_HALF_UP = tl.constexpr(element_formats.CODE_UINT_HALF_UP)
CODE_LLOYD = tl.constexpr(element_formats.CODE_LLOYD)
CODE_Q8_0 = tl.constexpr(element_formats.CODE_Q8_0)
CODE_IQ4_NL = tl.constexpr(element_formats.CODE_IQ4_NL)
CODE_GGML_SIGNED = tl.constexpr(element_formats.CODE_GGML_SIGNED)
CODE_GGML_MIN = tl.constexpr(element_formats.CODE_GGML_MIN)
# Added to a Lloyd-Max group's norm before dividing by it; TurboQuant values' smallest scale.
_NORM_EPS = tl.constexpr(NORM_EPS)
_HALF_UP_SCALE_FLOOR = tl.constexpr(HALF_UP_SCALE_FLOOR)

# fp32 elements one program handles in the quantize / dequantize launchers.
TILE_ELEMENTS = 4096


# Launch options of every kernel that stores codes or scales. Compiled code contracts x * y + z
# into one FMA (one rounding) where the interpreter and the torch references round twice, so a
# value on a rounding boundary would get a neighbouring code on the GPU alone; stored bytes are
# the format's definition and must not depend on the device.
EXACT_ARITHMETIC = {"enable_fp_fusion": False}


def format_switches(fmt: KVFormat, prefix: str = "") -> dict[str, int | bool]:
    """Constexpr switches of a format for the device helpers, keys prefixed (e.g. "K_").

    CODE: CODE_FLOAT (stored as fp32/fp16/bf16), CODE_E4M3, CODE_E2M1, CODE_E2M1_TIES_AWAY,
    CODE_E2M1_4OVER6, CODE_INT4_ZERO_IN_SCALE, CODE_INT8_SYMMETRIC, CODE_Q8_0, CODE_IQ4_NL, or
    a family's CODE + bits (CODE_UINT: asymmetric integer codes with zero points;
    CODE_UINT_HALF_UP, CODE_LLOYD: vLLM TurboQuant's value and key codes; CODE_GGML_SIGNED,
    CODE_GGML_MIN: llama.cpp's q4_0 / q5_0 and q4_1 / q5_1);
    GROUP_SIZE: elements a group scale covers, 0 for none; SCALE_DTYPE: the SCALE code of the
    group scales' dtype (0 fp16, 1 e4m3, 2 fp32, 3 ue8m0; 0 when unquantized); TOKEN_GROUP:
    consecutive rows sharing a row of scales.
    """
    return {
        f"{prefix}CODE": fmt.element.code,
        f"{prefix}GROUP_SIZE": fmt.group_size or 0,
        f"{prefix}SCALE_DTYPE": fmt.scale_format.code if fmt.quantized else 0,
        f"{prefix}TOKEN_GROUP": fmt.token_group,
    }


def check_kernel_format(fmt: KVFormat, head_dim: int) -> None:
    """Raise if the Triton helpers cannot handle this format (group sizes are powers of two)."""
    fmt.check_head_dim(head_dim)
    for name, size in (("group_size", fmt.group_size), ("token_group", fmt.token_group)):
        if size is not None and size & (size - 1):
            raise ValueError(f"{name}={size}: the Triton kernels need a power of two")


def code_width(fmt: KVFormat, head_dim: int) -> int:
    """Last-dim size of stored codes: head_dim elements when unquantized, else code bytes."""
    return fmt.code_bytes(head_dim) if fmt.quantized else head_dim


def tensor_scale_or_one(tensor_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The fp32 one-element tensor scale the helpers load; None means 1."""
    if tensor_scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if tensor_scale.numel() != 1 or tensor_scale.dtype != torch.float32:
        raise ValueError(
            f"tensor_scale: dtype {tensor_scale.dtype} with {tensor_scale.numel()} elements, "
            "must be a one-element torch.float32 tensor"
        )
    return tensor_scale.reshape(1)


@triton.jit
def cast_for_store(values, dtype: tl.constexpr):
    """fp32 tile -> dtype, round to nearest even (bf16 through `round_to_bf16`)."""
    if dtype == tl.bfloat16:
        return round_to_bf16(values)
    return values.to(dtype)


@triton.jit
def load_dequant_tile(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    rows,
    head,
    mask,
    dims,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE_DTYPE: tl.constexpr,
    TOKEN_GROUP: tl.constexpr,
):
    """fp32 tile [len(rows), len(dims)] of dequantized vectors.

    Vector (row, head) lives at codes[row, head, :] and scales[row // TOKEN_GROUP, head, :] of
    contiguous buffers [*, NUM_HEADS, width] and [*, NUM_HEADS, HEAD_DIM / GROUP_SIZE]. rows:
    int tile [R] (int32 or int64); head: scalar or int tile [R]; mask: bool [R]; dims: int tile
    [C] of element indices. Masked rows and dims >= HEAD_DIM read as 0. scales_ptr is read only when
    GROUP_SIZE > 0 (pass any pointer otherwise); tensor_scale_ptr (fp32, one element, > 0) for
    quantized formats.
    """
    vectors = rows.to(tl.int64) * NUM_HEADS + head
    dmask = mask[:, None] & (dims[None, :] < HEAD_DIM)
    if CODE == CODE_FLOAT:
        offsets = vectors[:, None] * HEAD_DIM + dims[None, :]
        values = tl.load(codes_ptr + offsets, mask=dmask, other=0.0).to(tl.float32)
    else:
        BITS: tl.constexpr = code_property(CODE, "bits")
        FAMILY: tl.constexpr = code_property(CODE, "family")
        # Element i starts at bit i * BITS of the vector's little-endian bit stream.
        bits = dims[None, :] * BITS
        offsets = vectors[:, None] * (HEAD_DIM * BITS // 8) + bits // 8
        codes = tl.load(codes_ptr + offsets, mask=dmask, other=0)
        if 8 % BITS != 0:
            shifts = bits % 8
            # A code that straddles two bytes takes its high bits from the next byte.
            high = tl.load(codes_ptr + offsets + 1, mask=dmask & (shifts + BITS > 8), other=0)
            codes = ((codes.to(tl.int32) | (high.to(tl.int32) << 8)) >> shifts) & (2**BITS - 1)
        elif BITS < 8:
            codes = (codes >> (bits % 8).to(tl.uint8)) & (2**BITS - 1)
        if CODE == CODE_E4M3:
            values = decode_e4m3(codes)
        elif CODE == CODE_E2M1 or CODE == CODE_E2M1_TIES_AWAY or CODE == CODE_E2M1_4OVER6:  # noqa: SIM109
            values = decode_e2m1(codes)
        elif CODE == CODE_INT8_SYMMETRIC or CODE == CODE_Q8_0:  # noqa: SIM109
            values = decode_int8_symmetric(codes)
        elif FAMILY == CODE_GGML_SIGNED:
            values = decode_ggml_signed(codes, BITS)
        elif CODE == CODE_IQ4_NL:
            values = decode_iq4_nl(codes)
        elif FAMILY == CODE_LLOYD:
            levels = tl.where(dmask, decode_lloyd(codes, BITS, GROUP_SIZE), 0.0)
            values = _unit_groups(levels, GROUP_SIZE)
        else:
            values = codes.to(tl.float32)
        if GROUP_SIZE > 0:
            ZERO_POINT: tl.constexpr = code_property(CODE, "zero_point")
            NUM_GROUPS: tl.constexpr = HEAD_DIM // GROUP_SIZE
            PARAMS: tl.constexpr = 2 if ZERO_POINT else 1
            scale_rows = (rows.to(tl.int64) // TOKEN_GROUP) * NUM_HEADS + head
            offsets = scale_rows[:, None] * (NUM_GROUPS * PARAMS) + dims[None, :] // GROUP_SIZE
            stored = tl.load(scales_ptr + offsets, mask=dmask, other=0)
            if CODE == CODE_INT4_ZERO_IN_SCALE:
                scale, zero = split_scale_word(stored)
                values = (values - zero) * scale
            else:
                values = values * decode_scale(stored, SCALE_DTYPE)
            if ZERO_POINT:
                zero = tl.load(scales_ptr + offsets + NUM_GROUPS, mask=dmask, other=0)
                values = values + zero.to(tl.float32)
        values = values * tl.load(tensor_scale_ptr)
    return values


@triton.jit
def _group_norms(grouped):
    """fp32 L2 norms [R, G] of groups [R, G, n], summed in fp64 (where the squares of fp32
    values are exact, so the result does not depend on the summation order)."""
    wide = grouped.to(tl.float64)
    return tl.sqrt(tl.sum(wide * wide, axis=2)).to(tl.float32)


@triton.jit
def _unit_groups(values, GROUP_SIZE: tl.constexpr):
    """Each group of GROUP_SIZE elements of a tile [R, C] divided by its L2 norm (norm
    correction of Lloyd-Max levels; all-zero groups stay 0)."""
    BLOCK_R: tl.constexpr = values.shape[0]
    BLOCK_C: tl.constexpr = values.shape[1]
    grouped = tl.reshape(values, (BLOCK_R, BLOCK_C // GROUP_SIZE, GROUP_SIZE))
    norms = _group_norms(grouped)[:, :, None]
    divisor = tl.broadcast_to(tl.where(norms == 0.0, 1.0, norms), grouped.shape)
    return tl.reshape(tl.math.div_rn(grouped, divisor), (BLOCK_R, BLOCK_C))


@triton.jit
def _e2m1_squared_error(grouped, scale):
    """fp64 [R, G]: squared error of E2M1 codes of groups [R, G, n] under scales [R, G] (in
    fp64, where the squares of fp32 differences are exact, so the choice of
    `_group_parameters` does not depend on summation order)."""
    divisor = tl.where(scale == 0.0, 1.0, scale)[:, :, None]
    units = tl.math.div_rn(grouped, tl.broadcast_to(divisor, grouped.shape))
    restored = decode_e2m1(encode_e2m1(units)) * scale[:, :, None]
    error = restored.to(tl.float64) - grouped.to(tl.float64)
    return tl.sum(error * error, axis=2)


@triton.jit
def _group_scale(span, SCALE: tl.constexpr, MAX_CODE: tl.constexpr):
    """(stored, fp32 decoded) group scale span / MAX_CODE in the SCALE dtype, floored."""
    exact = tl.math.div_rn(span, tl.full(span.shape, MAX_CODE, tl.float32))
    FLOOR: tl.constexpr = scale_floor(SCALE)
    if FLOOR > 0:
        exact = tl.maximum(exact, FLOOR)
    stored = encode_scale(exact, SCALE)
    return stored, decode_scale(stored, SCALE)


@triton.jit
def _group_parameters(
    scaled,
    scales_ptr,
    vectors,
    mask,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE: tl.constexpr,
    CODE: tl.constexpr,
):
    """Store the group scales (SCALE dtype) of a tile in tensor-scaled units, then its zero
    points for asymmetric CODEs; return scales and zero points (0 when symmetric) as fp32
    [R, G]. A CODE with a second scale candidate (E2M1 4over6) keeps, per group, the one with
    the smaller squared error (the first on a tie)."""
    ZERO_POINT: tl.constexpr = code_property(CODE, "zero_point")
    FAMILY: tl.constexpr = code_property(CODE, "family")
    MAX_CODE: tl.constexpr = code_property(CODE, "max_code")
    ALT_MAX_CODE: tl.constexpr = code_property(CODE, "alt_max_code")
    BLOCK_R: tl.constexpr = scaled.shape[0]
    NUM_GROUPS: tl.constexpr = scaled.shape[1] // GROUP_SIZE
    grouped = tl.reshape(scaled, (BLOCK_R, NUM_GROUPS, GROUP_SIZE))
    if CODE == CODE_INT4_ZERO_IN_SCALE:
        low, high = tl.min(grouped, axis=2), tl.max(grouped, axis=2)
        scale, zero, stored = zero_in_scale_parameters(low, high)
    elif code_property(CODE, "ggml_block"):
        # "scale" is ggml's multiplier id and "zero" its fp32 minimum (`_to_code_units`).
        BITS: tl.constexpr = code_property(CODE, "bits")
        if FAMILY == CODE_GGML_SIGNED:
            stored, scale, stored_zero, zero = ggml_signed_parameters(grouped, BITS)
        elif FAMILY == CODE_GGML_MIN:
            stored, scale, stored_zero, zero = ggml_min_parameters(grouped, BITS)
        elif CODE == CODE_Q8_0:
            stored, scale, stored_zero, zero = q8_0_parameters(grouped)
        else:
            stored, scale, stored_zero, zero = iq4_nl_parameters(grouped)
    elif FAMILY == CODE_LLOYD:
        # Stored: the fp16 norm; coded: coordinates of x / (fp32 norm + eps).
        zero = tl.zeros((BLOCK_R, NUM_GROUPS), tl.float32)
        norm = _group_norms(grouped)
        stored = norm.to(tl.float16)
        scale = norm + _NORM_EPS
    elif FAMILY == CODE_UINT_HALF_UP:
        # Coded from the fp32 minimum and scale; both stored in fp16.
        zero = tl.min(grouped, axis=2)
        span = tl.max(grouped, axis=2) - zero
        levels = tl.full(span.shape, MAX_CODE, tl.float32)
        scale = tl.maximum(tl.math.div_rn(span, levels), _HALF_UP_SCALE_FLOOR)
        stored, stored_zero = scale.to(tl.float16), zero.to(tl.float16)
    elif ZERO_POINT:
        stored_zero = tl.min(grouped, axis=2).to(tl.float16)
        zero = stored_zero.to(tl.float32)
        span = tl.maximum(tl.max(grouped, axis=2) - zero, 0.0)
        stored, scale = _group_scale(span, SCALE, MAX_CODE)
    else:
        zero = tl.zeros((BLOCK_R, NUM_GROUPS), tl.float32)
        span = tl.max(tl.abs(grouped), axis=2)
        stored, scale = _group_scale(span, SCALE, MAX_CODE)
    if ALT_MAX_CODE > 0:
        stored_alt, scale_alt = _group_scale(span, SCALE, ALT_MAX_CODE)
        use_alt = _e2m1_squared_error(grouped, scale_alt) < _e2m1_squared_error(grouped, scale)
        stored = tl.where(use_alt, stored_alt, stored)
        scale = tl.where(use_alt, scale_alt, scale)
    PARAMS: tl.constexpr = 2 if ZERO_POINT else 1
    groups = tl.arange(0, NUM_GROUPS)
    offsets = vectors[:, None] * (PARAMS * (HEAD_DIM // GROUP_SIZE)) + groups[None, :]
    group_mask = mask[:, None] & (groups[None, :] < HEAD_DIM // GROUP_SIZE)
    tl.store(scales_ptr + offsets, stored, mask=group_mask)
    if ZERO_POINT:
        tl.store(scales_ptr + offsets + HEAD_DIM // GROUP_SIZE, stored_zero, mask=group_mask)
    return scale, zero


@triton.jit
def _store_codes(
    codes_ptr,
    vectors,
    mask,
    scaled,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """Encode a tile [R, BLOCK_D] already in code units and store it, packed, at vectors."""
    BLOCK_R: tl.constexpr = scaled.shape[0]
    BLOCK_D: tl.constexpr = scaled.shape[1]
    BITS: tl.constexpr = code_property(CODE, "bits")
    FAMILY: tl.constexpr = code_property(CODE, "family")
    if CODE == CODE_E4M3:
        codes = encode_e4m3(scaled).to(tl.int32)
    elif CODE == CODE_E2M1 or CODE == CODE_E2M1_4OVER6:  # noqa: SIM109 (constexprs)
        codes = encode_e2m1(scaled).to(tl.int32)
    elif CODE == CODE_E2M1_TIES_AWAY:
        codes = encode_e2m1_ties_away(scaled).to(tl.int32)
    elif CODE == CODE_INT8_SYMMETRIC:
        codes = encode_int8_symmetric(scaled)
    elif CODE == CODE_INT4_ZERO_IN_SCALE:
        codes = encode_zero_in_scale(scaled)
    elif CODE == CODE_Q8_0:
        codes = encode_q8_0(scaled)
    elif CODE == CODE_IQ4_NL:
        codes = encode_iq4_nl(scaled)
    elif FAMILY == CODE_GGML_SIGNED:
        codes = encode_ggml_signed(scaled, BITS)
    elif FAMILY == CODE_GGML_MIN:
        codes = encode_ggml_min(scaled, BITS)
    elif FAMILY == CODE_LLOYD:
        codes = encode_lloyd(scaled, BITS, GROUP_SIZE)
    elif FAMILY == CODE_UINT_HALF_UP:
        codes = encode_uint_half_up(scaled, BITS)
    else:
        codes = encode_uint(scaled, BITS)
    # CHUNK codes fill CHUNK_BYTES whole bytes; code j of a chunk goes to bit j * BITS of its
    # little-endian word (disjoint bit fields: their sum is their bitwise or), 64 bits wide
    # where a chunk takes more than 32 (5-bit codes: 8 in 5 bytes).
    CHUNK: tl.constexpr = code_property(CODE, "chunk")
    CHUNK_BYTES: tl.constexpr = CHUNK * BITS // 8
    if CHUNK * BITS > 32:
        codes = codes.to(tl.int64)
    if CHUNK > 1:
        shifts = tl.arange(0, CHUNK) * BITS
        chunks = tl.reshape(codes, (BLOCK_R, BLOCK_D // CHUNK, CHUNK))
        codes = tl.sum(chunks << shifts[None, None, :], axis=2)
    chunk_ids = tl.arange(0, BLOCK_D // CHUNK)
    chunk_mask = mask[:, None] & (chunk_ids[None, :] < HEAD_DIM // CHUNK)
    starts = vectors[:, None] * (HEAD_DIM * BITS // 8) + chunk_ids[None, :] * CHUNK_BYTES
    for byte in tl.static_range(CHUNK_BYTES):
        stored = ((codes >> (8 * byte)) & 0xFF).to(tl.uint8)
        tl.store(codes_ptr + starts + byte, stored, mask=chunk_mask)


@triton.jit
def _to_code_units(grouped, scale, zero, CODE: tl.constexpr, RECIPROCAL: tl.constexpr):
    """(x - zero) / scale per group, or (x - zero) * fp32(1 / scale) with RECIPROCAL (0 where a
    group's scale is 0; zero is 0 for symmetric CODEs), or x * fp32(1 / scale) + zero for the
    zero-in-scale int4 codes, or (x - minimum) * id for llama.cpp's types (scale holds id, zero
    the minimum); grouped [..., G, n] with scale and zero broadcastable to it."""
    if CODE == CODE_INT4_ZERO_IN_SCALE:
        return zero_in_scale_units(grouped, scale, zero)
    if code_property(CODE, "ggml_block"):
        return (grouped - zero) * scale
    if code_property(CODE, "zero_point"):
        grouped = grouped - zero
    divisor = tl.where(scale == 0.0, 1.0, scale)
    if RECIPROCAL:
        inverse = tl.math.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)
        units = grouped * inverse
    else:
        units = tl.math.div_rn(grouped, tl.broadcast_to(divisor, grouped.shape))
    return tl.where(scale == 0.0, 0.0, units)


@triton.jit
def quantize_store_tile(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    rows,
    head,
    mask,
    values,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE_DTYPE: tl.constexpr,
):
    """Quantize an fp32 tile [R, BLOCK_D] of whole vectors and store codes and group scales.

    values[:, d] is element d (BLOCK_D = values.shape[1], a power of two >= HEAD_DIM; columns
    >= HEAD_DIM are ignored). Addressing as in `load_dequant_tile` (per-token formats only);
    masked rows store nothing. Unquantized formats store values cast to the codes buffer's dtype.
    """
    BLOCK_R: tl.constexpr = values.shape[0]
    BLOCK_D: tl.constexpr = values.shape[1]
    dims = tl.arange(0, BLOCK_D)
    vectors = rows.to(tl.int64) * NUM_HEADS + head
    dmask = mask[:, None] & (dims[None, :] < HEAD_DIM)
    if CODE == CODE_FLOAT:
        offsets = vectors[:, None] * HEAD_DIM + dims[None, :]
        stored = cast_for_store(values, codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + offsets, stored, mask=dmask)
    else:
        tensor_scale = tl.full(values.shape, tl.load(tensor_scale_ptr), tl.float32)
        scaled = tl.where(dmask, tl.math.div_rn(values, tensor_scale), 0.0)
        if GROUP_SIZE > 0:
            NUM_GROUPS: tl.constexpr = BLOCK_D // GROUP_SIZE
            grouped = tl.reshape(scaled, (BLOCK_R, NUM_GROUPS, GROUP_SIZE))
            scale, zero = _group_parameters(
                scaled, scales_ptr, vectors, mask, HEAD_DIM, GROUP_SIZE, SCALE_DTYPE, CODE
            )
            grouped = _to_code_units(
                grouped,
                scale[:, :, None],
                zero[:, :, None],
                CODE,
                scale_reciprocal(SCALE_DTYPE),
            )
            scaled = tl.reshape(grouped, (BLOCK_R, BLOCK_D))
        _store_codes(codes_ptr, vectors, mask, scaled, HEAD_DIM, CODE, GROUP_SIZE)


@triton.jit
def quantize_store_token_groups(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    first_row,
    head,
    values,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE_DTYPE: tl.constexpr,
):
    """Quantize the fp32 tile [TOKEN_GROUP, BLOCK_D] of rows first_row ... (one token group of
    a token-grouped format, one head) and store its codes and its one row of scales."""
    TOKEN_GROUP: tl.constexpr = values.shape[0]
    BLOCK_D: tl.constexpr = values.shape[1]
    NUM_GROUPS: tl.constexpr = BLOCK_D // GROUP_SIZE
    dims = tl.arange(0, BLOCK_D)
    rows = first_row.to(tl.int64) + tl.arange(0, TOKEN_GROUP)
    dmask = dims[None, :] < HEAD_DIM
    tensor_scale = tl.full(values.shape, tl.load(tensor_scale_ptr), tl.float32)
    scaled = tl.where(dmask, tl.math.div_rn(values, tensor_scale), 0.0)
    grouped = tl.reshape(scaled, (TOKEN_GROUP, NUM_GROUPS, GROUP_SIZE))
    # A token group's parameters are those of one long group: all its rows at once.
    across_rows = tl.reshape(
        tl.permute(grouped, (1, 0, 2)), (1, NUM_GROUPS, TOKEN_GROUP * GROUP_SIZE)
    )
    scale, zero = _group_parameters(
        tl.reshape(across_rows, (1, NUM_GROUPS * TOKEN_GROUP * GROUP_SIZE)),
        scales_ptr,
        (first_row.to(tl.int64) // TOKEN_GROUP) * NUM_HEADS + head + tl.zeros((1,), tl.int64),
        tl.full((1,), True, tl.int1),
        HEAD_DIM * TOKEN_GROUP,
        GROUP_SIZE * TOKEN_GROUP,
        SCALE_DTYPE,
        CODE,
    )
    grouped = _to_code_units(
        grouped, scale[:, :, None], zero[:, :, None], CODE, scale_reciprocal(SCALE_DTYPE)
    )
    scaled = tl.reshape(grouped, (TOKEN_GROUP, BLOCK_D))
    vectors = rows * NUM_HEADS + head
    _store_codes(
        codes_ptr,
        vectors,
        tl.full((TOKEN_GROUP,), True, tl.int1),
        scaled,
        HEAD_DIM,
        CODE,
        GROUP_SIZE,
    )


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    num_vectors,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE_DTYPE: tl.constexpr,
    TOKEN_GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < num_vectors
    dims = tl.arange(0, BLOCK_D)
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(x_ptr + offsets, mask=mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    quantize_store_tile(
        codes_ptr,
        scales_ptr,
        tensor_scale_ptr,
        rows,
        0,
        mask,
        x.to(tl.float32),
        1,
        HEAD_DIM,
        CODE,
        GROUP_SIZE,
        SCALE_DTYPE,
    )


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    tensor_scale_ptr,
    out_ptr,
    num_vectors,
    HEAD_DIM: tl.constexpr,
    CODE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALE_DTYPE: tl.constexpr,
    TOKEN_GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < num_vectors
    dims = tl.arange(0, BLOCK_D)
    values = load_dequant_tile(
        codes_ptr,
        scales_ptr,
        tensor_scale_ptr,
        rows,
        0,
        mask,
        dims,
        1,
        HEAD_DIM,
        CODE,
        GROUP_SIZE,
        SCALE_DTYPE,
        TOKEN_GROUP,
    )
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    out_mask = mask[:, None] & (dims[None, :] < HEAD_DIM)
    tl.store(out_ptr + offsets, cast_for_store(values, out_ptr.dtype.element_ty), mask=out_mask)


def vector_tiles(num_vectors: int, head_dim: int) -> tuple[int, int, int]:
    """Programs, vectors a program (BLOCK_R) and padded head_dim (BLOCK_D) for launchers that
    give each program a tile of whole vectors of about TILE_ELEMENTS elements."""
    block_d = triton.next_power_of_2(head_dim)
    block_r = min(max(1, TILE_ELEMENTS // block_d), triton.next_power_of_2(max(1, num_vectors)))
    return triton.cdiv(num_vectors, block_r), block_r, block_d


def quantize(
    x: torch.Tensor, fmt: KVFormat, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize vectors x [..., D] (fp32/fp16/bf16) to fmt.

    Returns codes [..., code width] (uint8 D or D/2 bytes, or fmt's float dtype with D
    elements) and group scales [..., D / group_size] (fp16 or uint8 E4M3), or None.
    """
    head_dim = x.shape[-1]
    check_kernel_format(fmt, head_dim)
    if fmt.token_group > 1:
        raise ValueError(f"{fmt}: token-grouped formats are quantized a block at a time")
    x = x.contiguous()
    tensor_scale = tensor_scale_or_one(tensor_scale, x.device)
    codes = x.new_empty(*x.shape[:-1], code_width(fmt, head_dim), dtype=fmt.code_torch_dtype)
    groups = fmt.scales_per_vector(head_dim)
    scales = x.new_empty(*x.shape[:-1], groups, dtype=fmt.scale_torch_dtype) if groups else None
    num_vectors = x.numel() // head_dim if head_dim else 0
    if num_vectors == 0:
        return codes, scales
    programs, block_r, block_d = vector_tiles(num_vectors, head_dim)
    _quantize_kernel[(programs,)](
        x,
        codes,
        scales if scales is not None else codes,
        tensor_scale,
        num_vectors,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **format_switches(fmt),
        **EXACT_ARITHMETIC,
    )
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: KVFormat,
    tensor_scale: torch.Tensor | None,
    head_dim: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Values [..., head_dim] in out_dtype of codes and scales made by `quantize`."""
    check_kernel_format(fmt, head_dim)
    _check_codes(codes, scales, fmt, head_dim)
    codes = codes.contiguous()
    tensor_scale = tensor_scale_or_one(tensor_scale, codes.device)
    out = codes.new_empty(*codes.shape[:-1], head_dim, dtype=out_dtype)
    num_vectors = out.numel() // head_dim if head_dim else 0
    if num_vectors == 0:
        return out
    programs, block_r, block_d = vector_tiles(num_vectors, head_dim)
    _dequantize_kernel[(programs,)](
        codes,
        scales.contiguous() if scales is not None else codes,
        tensor_scale,
        out,
        num_vectors,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        **format_switches(fmt),
        **EXACT_ARITHMETIC,
    )
    return out


def _check_codes(
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: KVFormat,
    head_dim: int,
    broadcast: bool = False,
) -> None:
    """Raise early if codes / scales do not hold head_dim-element vectors of fmt. With
    broadcast (the torch reference) a scale row may serve several vectors: a dim of 1 in
    scales stands for all of codes' along it."""
    width = code_width(fmt, head_dim)
    if codes.dtype != fmt.code_torch_dtype or codes.shape[-1] != width:
        raise ValueError(
            f"codes: dtype {codes.dtype}, last dim {codes.shape[-1]}; {fmt} with "
            f"head_dim={head_dim} needs {fmt.code_torch_dtype} and {width}"
        )
    groups = fmt.scales_per_vector(head_dim)
    expected = (*codes.shape[:-1], groups)
    if groups == 0 and scales is not None:
        raise ValueError(f"scales: must be None for {fmt}")
    if groups and (
        scales is None or not _scale_shape_fits(tuple(scales.shape), expected, broadcast)
    ):
        raise ValueError(f"scales: must have shape {expected} for {fmt}")
    if groups and scales.dtype != fmt.scale_torch_dtype:
        raise ValueError(f"scales.dtype={scales.dtype}: {fmt} needs {fmt.scale_torch_dtype}")


def _scale_shape_fits(shape: tuple[int, ...], expected: tuple[int, ...], broadcast: bool) -> bool:
    """The expected shape, or with broadcast the same rank and last dim, others equal or 1."""
    if shape == expected:
        return True
    if not broadcast or len(shape) != len(expected) or shape[-1] != expected[-1]:
        return False
    return all(have in (1, want) for have, want in zip(shape[:-1], expected[:-1], strict=True))


def quantize_ref(
    x: torch.Tensor, fmt: KVFormat, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of `quantize` (same signature, same bits).

    A token-grouped format takes vectors [N, H, D] (N a multiple of token_group, groups of
    consecutive rows) and returns scales [N / token_group, H, scales_per_vector]."""
    head_dim = x.shape[-1]
    fmt.check_head_dim(head_dim)
    if not fmt.quantized:
        return x.to(fmt.code_torch_dtype), None
    tensor_scale = tensor_scale_or_one(tensor_scale, x.device)
    scaled = x.float() / tensor_scale
    if fmt.group_size is None:
        return fmt.element.encode(scaled), None
    groups, size, rows = head_dim // fmt.group_size, fmt.group_size, fmt.token_group
    if rows == 1:
        grouped = scaled.unflatten(-1, (groups, size))
    else:
        if x.dim() != 3 or x.shape[0] % rows:
            raise ValueError(f"x.shape={tuple(x.shape)}: {fmt} needs [N * {rows}, H, D]")
        # [N/rows, rows, H, G, size] -> one long group per (row group, head, channel group).
        blocked = scaled.unflatten(0, (-1, rows)).unflatten(-1, (groups, size))
        grouped = blocked.permute(0, 2, 3, 1, 4).flatten(-2)
    in_code_units, scales = quantize_groups_ref(grouped, fmt)
    if rows == 1:
        scaled = in_code_units.flatten(-2)
    else:
        unblocked = in_code_units.unflatten(-1, (rows, size)).permute(0, 3, 1, 2, 4)
        scaled = unblocked.flatten(-2).flatten(0, 1)
    return fmt.element.encode(scaled), scales


def quantize_groups_ref(grouped: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups [..., G, n] in tensor-scaled units -> (the same in code units, stored scales
    [..., G] or [..., 2G] with the zero points after the scales)."""
    family = fmt.element.family
    if family == element_formats.CODE_INT4_ZERO_IN_SCALE:
        scale, zero, scales = zero_in_scale_parameters_ref(grouped.amin(-1), grouped.amax(-1))
        return zero_in_scale_units_ref(grouped, scale[..., None], zero[..., None]), scales
    if fmt.element.ggml_block:
        return _ggml_groups_ref(grouped, fmt)
    if family == element_formats.CODE_LLOYD:
        norm = _group_norms_ref(grouped)
        return grouped / (norm + NORM_EPS)[..., None], norm.half()
    if family == element_formats.CODE_UINT_HALF_UP:
        low = grouped.amin(dim=-1)
        scale = ((grouped.amax(dim=-1) - low) / fmt.max_code).clamp(min=HALF_UP_SCALE_FLOOR)
        units = (grouped - low[..., None]) / scale[..., None]
        return units, torch.cat((scale.half(), low.half()), dim=-1)
    if fmt.zero_point:
        zeros = grouped.amin(dim=-1).half()
        span = (grouped.amax(dim=-1) - zeros.float()).clamp(min=0)
        scales = (span / fmt.max_code).half()
        scale = scales.float()
        grouped = grouped - zeros.float()[..., None]
        scales = torch.cat((scales, zeros), dim=-1)
    else:
        scales, scale = _group_scale_ref(grouped, fmt, fmt.max_code)
        if fmt.element.alt_max_code:
            scales_alt, scale_alt = _group_scale_ref(grouped, fmt, fmt.element.alt_max_code)
            use_alt = _e2m1_squared_error_ref(grouped, scale_alt) < _e2m1_squared_error_ref(
                grouped, scale
            )
            scales = torch.where(use_alt, scales_alt, scales)
            scale = torch.where(use_alt, scale_alt, scale)
    divisor = torch.where(scale == 0, 1.0, scale)[..., None]
    units = grouped * (1.0 / divisor) if fmt.scale_format.reciprocal else grouped / divisor
    return torch.where(scale[..., None] == 0, 0.0, units), scales


def _ggml_groups_ref(grouped: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups_ref` for llama.cpp's types: units (x - minimum) * id, stored fp16 d
    (and fp16 minimum)."""
    element, family = fmt.element, fmt.element.family
    if family == element_formats.CODE_GGML_SIGNED:
        d, multiplier, low = ggml_signed_parameters_ref(grouped, element.bits)
    elif family == element_formats.CODE_GGML_MIN:
        d, multiplier, low = ggml_min_parameters_ref(grouped, element.bits)
    elif family == element_formats.CODE_Q8_0:
        d, multiplier, low = q8_0_parameters_ref(grouped)
    else:
        d, multiplier, low = iq4_nl_parameters_ref(grouped)
    if low is None:
        return grouped * multiplier[..., None], d.half()
    units = (grouped - low[..., None]) * multiplier[..., None]
    return units, torch.cat((d.half(), low.half()), dim=-1)


def _group_norms_ref(grouped: torch.Tensor) -> torch.Tensor:
    """Torch reference of `_group_norms`: fp32 L2 norms of groups [..., G, n] (via fp64)."""
    return grouped.double().square().sum(dim=-1).sqrt().float()


def _group_scale_ref(
    grouped: torch.Tensor, fmt: KVFormat, max_code: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored, fp32 decoded) symmetric group scales amax / max_code of groups [..., G, n]."""
    scale_format = fmt.scale_format
    exact = (grouped.abs().amax(dim=-1) / max_code).clamp(min=scale_format.floor)
    stored = scale_format.encode(exact)
    return stored, scale_format.decode(stored)


def _e2m1_squared_error_ref(grouped: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp64 [..., G]: squared error of E2M1 codes of groups [..., G, n] under scales [..., G]."""
    divisor = torch.where(scale == 0, 1.0, scale)[..., None]
    restored = decode_e2m1_ref(encode_e2m1_fast(grouped / divisor)) * scale[..., None]
    return ((restored.double() - grouped.double()) ** 2).sum(dim=-1)


def dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    fmt: KVFormat,
    tensor_scale: torch.Tensor | None,
    head_dim: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Torch reference of `dequantize` (same signature, same bits); a scale row may serve
    several vectors (a dim of 1 in scales broadcasts), as a token-grouped pool stores it."""
    _check_codes(codes, scales, fmt, head_dim, broadcast=True)
    if not fmt.quantized:
        return codes.to(out_dtype)
    values = fmt.element.decode(codes)
    family = fmt.element.family
    if family == element_formats.CODE_LLOYD:
        levels = decode_lloyd_ref(values.to(torch.uint8), fmt.element.bits, fmt.group_size)
        grouped = levels.unflatten(-1, (head_dim // fmt.group_size, -1))
        norms = _group_norms_ref(grouped)[..., None]
        values = (grouped / torch.where(norms == 0, 1.0, norms)).flatten(-2)
    if scales is not None and family == element_formats.CODE_INT4_ZERO_IN_SCALE:
        scale, zero = split_scale_word_ref(scales)
        values = (values.unflatten(-1, (scale.shape[-1], -1)) - zero[..., None]) * scale[..., None]
        values = values.flatten(-2)
    elif scales is not None:
        groups = head_dim // fmt.group_size
        scale = fmt.scale_format.decode(scales)
        grouped = values.unflatten(-1, (groups, -1))
        # In place where decoding made a fresh fp32 tensor (a new dtype is a new tensor): a
        # decode step's multi-megabyte temporaries cost more than the arithmetic on a CPU.
        if values.dtype == torch.float32 and codes.dtype != torch.float32:
            grouped *= scale[..., :groups, None]
        else:
            grouped = grouped * scale[..., :groups, None]
        if fmt.zero_point:
            grouped += scale[..., groups:, None]
        values = grouped.flatten(-2)
    if tensor_scale is not None:  # decoding made values a fresh fp32 tensor: scale it in place
        values *= tensor_scale_or_one(tensor_scale, codes.device)
    return values.to(out_dtype)
