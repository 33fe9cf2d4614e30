"""Reference encoders and decoders for llama.cpp's KV cache types, and its cache rotation.

What this is: plain numpy re-implementations, written from a reading of the llama.cpp that
llama-cpp-python 0.3.36 vendors (commit 0c1e570; the files are named in docs/engine_formats.md),
of what its CPU backend stores for each `--cache-type-k` / `--cache-type-v` type: ggml's block
structs (ggml/src/ggml-common.h), the quantize functions `ggml_set_rows` reaches through the
CPU type traits' from_float (ggml/src/ggml-quants.c's `quantize_row_*_ref`, and for q8_0 the
x86 AVX version in ggml/src/ggml-cpu/arch/x86/quants.c), the `dequantize_row_*` functions, and
the Walsh-Hadamard rotation of src/llama-kv-cache.cpp (`ggml_gen_hadamard`) as the CPU computes
it (ggml/src/ggml-cpu/ops.cpp, `ggml_compute_forward_fwht`). They are oracles for tests of
kvtune's implementations, so nothing here imports kvtune; slow and literal is the point: loops
follow the C loops (vectorized over blocks only), in float32 where the C code uses float.

Conventions: `x` is float32 [..., n] with n a multiple of 32, a row as ggml quantizes it (one
head vector of one token here); `quantize_row` returns the row's ggml block bytes (uint8 [...,
n / 32 * block bytes], the structs laid out as C lays them out on a little-endian machine, fp16
fields as their two bytes), `dequantize_row` reads them back. Inputs are finite.
"""

from __future__ import annotations

import numpy as np

QK = 32
F32 = np.float32
# ggml-common.h's kvalues_iq4nl.
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
GROUP_MAX_EPS = F32(1e-15)  # ggml-quants.c
# sizeof(block_<type>): ggml_half d [, ggml_half m] [, uint8_t qh[4]], then qs.
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
# common/arg.cpp's kv_cache_types, in its order.
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def _half_bytes(values: np.ndarray) -> np.ndarray:
    """fp16 (ggml_half, GGML_FP32_TO_FP16: round to nearest even) as two little-endian bytes."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _read_half(pair: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32 of two little-endian bytes [B, 2] -> float32 [B]."""
    return np.ascontiguousarray(pair).view(np.float16)[:, 0].astype(F32)


def _blocks_of(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """float32 blocks [B, 32] of x [..., n], and x's leading shape."""
    x = np.asarray(x, dtype=F32)
    if x.shape[-1] % QK:
        raise ValueError(f"x.shape[-1]={x.shape[-1]}: must be a multiple of {QK}")
    return x.reshape(-1, QK), x.shape[:-1]


def _signed_max(xb: np.ndarray) -> np.ndarray:
    """`if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` over j, from amax = max = 0."""
    amax = np.zeros(len(xb), dtype=F32)
    largest = np.zeros(len(xb), dtype=F32)
    for j in range(QK):
        v = xb[:, j]
        take = amax < np.abs(v)
        amax = np.where(take, np.abs(v), amax)
        largest = np.where(take, v, largest)
    return largest


def _min_max(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`if (v < min) min = v; if (v > max) max = v;` over j, from FLT_MAX and -FLT_MAX."""
    low = np.full(len(xb), np.finfo(F32).max, dtype=F32)
    high = np.full(len(xb), -np.finfo(F32).max, dtype=F32)
    for j in range(QK):
        low = np.where(xb[:, j] < low, xb[:, j], low)
        high = np.where(xb[:, j] > high, xb[:, j], high)
    return low, high


def _inverse(d: np.ndarray) -> np.ndarray:
    """`d ? 1.0f/d : 0.0f`."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """qs[j] = (low[j] & 0x0F) | (high[j] & 0x0F) << 4 for j < 16 (element j and j + 16)."""
    return ((low & 0x0F) | ((high & 0x0F) << 4)).astype(np.uint8)


def _high_bits(codes: np.ndarray) -> np.ndarray:
    """q5's qh: bit j of a little-endian uint32 is bit 4 of element j's code."""
    qh = np.zeros(len(codes), dtype=np.uint32)
    for j in range(QK):
        qh |= ((codes[:, j].astype(np.uint32) & 0x10) >> 4) << np.uint32(j)
    return qh.reshape(-1, 1).view(np.uint8)


def quantize_q4_0(xb: np.ndarray) -> np.ndarray:
    d = _signed_max(xb) / F32(-8)
    inv = _inverse(d)
    codes = np.minimum(15, np.trunc(xb * inv[:, None] + F32(8.5)).astype(np.int8))
    return np.concatenate([_half_bytes(d), _nibbles(codes[:, :16], codes[:, 16:])], axis=1)


def quantize_q4_1(xb: np.ndarray) -> np.ndarray:
    low, high = _min_max(xb)
    d = (high - low) / F32(15)
    inv = _inverse(d)
    units = (xb - low[:, None]) * inv[:, None]
    codes = np.minimum(15, np.trunc(units + F32(0.5)).astype(np.int8))
    nibbles = _nibbles(codes[:, :16], codes[:, 16:])
    return np.concatenate([_half_bytes(d), _half_bytes(low), nibbles], axis=1)


def quantize_q5_0(xb: np.ndarray) -> np.ndarray:
    d = _signed_max(xb) / F32(-16)
    inv = _inverse(d)
    codes = np.minimum(31, np.trunc(xb * inv[:, None] + F32(16.5)).astype(np.int8))
    nibbles = _nibbles(codes[:, :16], codes[:, 16:])
    return np.concatenate([_half_bytes(d), _high_bits(codes), nibbles], axis=1)


def quantize_q5_1(xb: np.ndarray) -> np.ndarray:
    low, high = _min_max(xb)
    d = (high - low) / F32(31)
    inv = _inverse(d)
    units = (xb - low[:, None]) * inv[:, None]
    codes = np.trunc(units + F32(0.5)).astype(np.uint8)  # (uint8_t)(x0 + 0.5f): no clamp
    nibbles = _nibbles(codes[:, :16], codes[:, 16:])
    return np.concatenate([_half_bytes(d), _half_bytes(low), _high_bits(codes), nibbles], axis=1)


def quantize_q8_0_x86(xb: np.ndarray) -> np.ndarray:
    """The AVX / AVX2 quantize_row_q8_0: d = max|x| / 127.f, id = 127.f / max|x|,
    _mm256_round_ps(x * id, _MM_ROUND_NEAREST) (halves to even), packed with saturation."""
    amax = np.abs(xb).max(axis=1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    codes = np.clip(np.rint(xb * inv[:, None]), -128, 127).astype(np.int8)
    return np.concatenate([_half_bytes(d), codes.view(np.uint8)], axis=1)


def quantize_q8_0_scalar(xb: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref (what gguf-py copies, and llama.cpp's scalar CPU path): id = 1/d,
    roundf (halves away from zero)."""
    amax = np.abs(xb).max(axis=1)
    d = amax / F32(127)
    inv = _inverse(d)
    units = (xb * inv[:, None]).astype(np.float64)  # roundf rounds the exact value
    codes = (np.sign(units) * np.floor(np.abs(units) + 0.5)).astype(np.int8)
    return np.concatenate([_half_bytes(d), codes.view(np.uint8)], axis=1)


def best_index_int8(values: np.ndarray, x: F32) -> int:
    """ggml-quants.c's best_index_int8, literally."""
    n = len(values)
    if x <= values[0]:
        return 0
    if x >= values[n - 1]:
        return n - 1
    ml, mu = 0, n - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - F32(values[mu - 1]) < F32(values[mu]) - x else mu


def quantize_iq4_nl(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_iq4_nl_ref: quantize_row_iq4_nl_impl(32, 32, ..., ntry = -1), block by block.
    Also returns whether each block's codes are defined (llama.cpp leaves the codes of a block
    with amax < GROUP_MAX_EPS as its stack buffer L held them)."""
    values = KVALUES_IQ4NL.astype(F32)
    out, defined = [], []
    for block in xb:
        weight = block * block
        amax, largest = F32(0), F32(0)
        for v in block:
            if np.abs(v) > amax:
                amax, largest = np.abs(v), v
        if amax < GROUP_MAX_EPS:
            out.append(np.concatenate([_half_bytes(np.array([F32(0)]))[0], np.zeros(16, np.uint8)]))
            defined.append(False)
            continue
        d = largest / values[0]
        inv = F32(1) / d
        codes = np.zeros(QK, dtype=np.uint8)
        sum_qx, sum_q2 = F32(0), F32(0)
        for j in range(QK):
            codes[j] = best_index_int8(values, inv * block[j])
            q, w = values[codes[j]], weight[j]
            sum_qx = F32(sum_qx + w * q * block[j])
            sum_q2 = F32(sum_q2 + w * q * q)
        d = sum_qx / sum_q2 if sum_q2 > 0 else F32(0)
        # ntry = -1: the loop `for (itry = -ntry; itry <= ntry; ++itry)` runs no try.
        nibbles = _nibbles(codes[:16], codes[16:])
        out.append(np.concatenate([_half_bytes(np.array([d]))[0], nibbles]))
        defined.append(True)
    return np.stack(out), np.array(defined)


QUANTIZE = {
    "q8_0": quantize_q8_0_x86,
    "q4_0": quantize_q4_0,
    "q4_1": quantize_q4_1,
    "q5_0": quantize_q5_0,
    "q5_1": quantize_q5_1,
    "iq4_nl": lambda xb: quantize_iq4_nl(xb)[0],
}


def quantize_row(x: np.ndarray, ggml_type: str) -> np.ndarray:
    """Block bytes uint8 [..., n / 32 * BLOCK_BYTES[type]] of rows x [..., n], as llama.cpp's
    CPU backend stores them (x86 for q8_0)."""
    return quantize_row_with(x, QUANTIZE[ggml_type])


def quantize_row_with(x: np.ndarray, quantize_blocks) -> np.ndarray:
    """Rows x [..., n] through one of the block quantizers above (blocks [B, 32] -> bytes)."""
    xb, lead = _blocks_of(x)
    return quantize_blocks(xb).reshape(*lead, -1)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[B, 16] qs -> [B, 32] 4-bit values: element j low, j + 16 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _unpack_q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_*: xh_0 = ((qh >> j) << 4) & 0x10, xh_1 = (qh >> (j + 12)) & 0x10."""
    high = np.ascontiguousarray(qh).view(np.uint32)[:, 0]
    j = np.arange(16, dtype=np.uint32)
    xh_0 = ((high[:, None] >> j) << 4) & 0x10
    xh_1 = (high[:, None] >> (j + 12)) & 0x10
    low = _unpack_nibbles(qs)
    return np.concatenate([low[:, :16] | xh_0, low[:, 16:] | xh_1], axis=1).astype(np.int32)


def dequantize_row(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """float32 [..., n] of block bytes [..., n / 32 * BLOCK_BYTES[type]] (dequantize_row_*)."""
    size = BLOCK_BYTES[ggml_type]
    lead = blocks.shape[:-1]
    b = np.ascontiguousarray(blocks).reshape(-1, size)
    d = _read_half(b[:, 0:2])[:, None]
    if ggml_type == "q8_0":
        values = b[:, 2:].view(np.int8).astype(F32) * d
    elif ggml_type == "q4_0":
        values = (_unpack_nibbles(b[:, 2:]) - 8).astype(F32) * d
    elif ggml_type == "q4_1":
        values = _unpack_nibbles(b[:, 4:]).astype(F32) * d + _read_half(b[:, 2:4])[:, None]
    elif ggml_type == "q5_0":
        values = (_unpack_q5(b[:, 2:6], b[:, 6:]) - 16).astype(F32) * d
    elif ggml_type == "q5_1":
        codes = _unpack_q5(b[:, 4:8], b[:, 8:]).astype(F32)
        values = codes * d + _read_half(b[:, 2:4])[:, None]
    elif ggml_type == "iq4_nl":
        values = d * KVALUES_IQ4NL[_unpack_nibbles(b[:, 2:])].astype(F32)
    else:
        raise ValueError(f"ggml_type={ggml_type!r}; allowed: {sorted(BLOCK_BYTES)}")
    return values.astype(F32).reshape(*lead, -1)


def block_codes(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """The element codes (uint8 [..., n]: q8_0 as its int8 bytes) of block bytes."""
    size = BLOCK_BYTES[ggml_type]
    lead = blocks.shape[:-1]
    b = np.ascontiguousarray(blocks).reshape(-1, size)
    if ggml_type == "q8_0":
        codes = b[:, 2:]
    elif ggml_type in ("q4_0", "iq4_nl"):
        codes = _unpack_nibbles(b[:, 2:])
    elif ggml_type == "q4_1":
        codes = _unpack_nibbles(b[:, 4:])
    elif ggml_type == "q5_0":
        codes = _unpack_q5(b[:, 2:6], b[:, 6:])
    else:
        codes = _unpack_q5(b[:, 4:8], b[:, 8:])
    return codes.astype(np.uint8).reshape(*lead, -1)


def block_scales(blocks: np.ndarray, ggml_type: str) -> np.ndarray:
    """fp16 d (and m after all the d, for the _1 types) per block: float16 [..., blocks (* 2)]."""
    size = BLOCK_BYTES[ggml_type]
    lead = blocks.shape[:-1]
    b = np.ascontiguousarray(blocks).reshape(-1, size)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].reshape(*lead, -1)
    if not ggml_type.endswith("_1"):
        return d
    m = b[:, 2:4].copy().view(np.float16)[:, 0].reshape(*lead, -1)
    return np.concatenate([d, m], axis=-1)


# --------------------------------------------------------------------------------------------
# The cache rotation (src/llama-kv-cache.cpp, src/llama-graph.cpp, ggml-cpu/ops.cpp)
# --------------------------------------------------------------------------------------------


def gen_hadamard(n: int) -> np.ndarray:
    """ggml_gen_hadamard: data[0] = 1.0 / sqrtf(n), then for s = 1, 2, 4 ...: each s x s
    block copied right and down, negated down-right. float32 [n, n]."""
    data = np.zeros((n, n), dtype=F32)
    data[0, 0] = F32(1.0 / float(np.sqrt(F32(n))))
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = data[i, j]
                data[i + s, j] = val
                data[i, j + s] = val
                data[i + s, j + s] = -val
        s *= 2
    return data


def fwht_row(row: np.ndarray) -> np.ndarray:
    """ggml_compute_forward_fwht on one row of n float32 values: each times 1.0f / sqrtf(n),
    then for len = 1, 2, 4 ...: (u, v) -> (u + v, u - v) at i + j and i + len + j."""
    n = len(row)
    scale = F32(1) / np.sqrt(F32(n))
    dst = (np.asarray(row, dtype=F32) * scale).astype(F32)
    length = 1
    while length < n:
        for i in range(0, n, 2 * length):
            for j in range(length):
                u, v = dst[i + j], dst[i + length + j]
                dst[i + j] = u + v
                dst[i + length + j] = u - v
        length *= 2
    return dst


def mul_mat_hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """llama_mul_mat_hadamard(x, rot) on the CPU: x [..., D] reshaped to rows of n consecutive
    elements (n divides D, so blocks along head_dim), each through the fwht."""
    rows = np.asarray(x, dtype=F32).reshape(-1, n)
    return np.stack([fwht_row(row) for row in rows]).reshape(np.shape(x))


def rotation_blocks(head_dim: int, quantized_k: bool, quantized_v: bool) -> tuple[int, int]:
    """The rot tensors' sizes (0: no rotation): attn_rot_k / attn_rot_v need a quantized type
    and n_embd_head % 64 == 0; K's nrot doubles from 64 while it divides n_embd_head_k_all (then
    halves back), V's is 64."""
    if head_dim % 64:
        return 0, 0
    nrot = 64
    while True:
        nrot *= 2
        if head_dim % nrot:
            break
    return (nrot // 2 if quantized_k else 0), (64 if quantized_v else 0)


# --------------------------------------------------------------------------------------------
# Bytes per token, per KV head, per layer (K and V together)
# --------------------------------------------------------------------------------------------


def stream_bytes(ggml_type: str, head_dim: int) -> int:
    """ggml_row_size of one head vector: head_dim / 32 blocks, or head_dim elements."""
    if ggml_type in ELEMENT_BYTES:
        return ELEMENT_BYTES[ggml_type] * head_dim
    return head_dim // QK * BLOCK_BYTES[ggml_type]
