"""llama.cpp's quantized cache types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) as kvtune stores
them, against two references: the numpy port of the pinned llama.cpp's code
(`llamacpp_formats_ref.py`, no kvtune imports) and gguf-py's quants (gguf 0.19.0, llama.cpp's
own Python package: it quantizes q4_0, q4_1, q5_0, q5_1 and q8_0, the last by ggml's scalar
reference, and dequantizes every type).

kvtune's codes and scales are compared as ggml's block bytes (`ggml_blocks.to_ggml_blocks`, shown
exact both ways here), written by the Triton kernel (under the interpreter) and by the torch
reference, and read back by the Triton reader, the torch reference and the native CPU reader,
on random data, outliers (fixed large channels, tiny and zero vectors) and ties (values on the
types' rounding boundaries, equal magnitudes of both signs, constant blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvtune.kernels.cache.pool import KVPool, read_blocks_into, read_vectors_ref
from kvtune.kernels.cache.write import write_kv, write_kv_ref
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.ggml_blocks import block_bytes, from_ggml_blocks, to_ggml_blocks
from kvtune.kernels.formats.int_codes import unpack_codes_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize, dequantize_ref, quantize, quantize_ref
from tests.kernels.formats import llamacpp_formats_ref as ref

GGML_TYPES = [name for name, element in ELEMENT_FORMATS.items() if element.ggml_block]
# The types gguf-py quantizes as llama.cpp's CPU stores them (its q8_0 is the scalar reference).
GGUF_QUANTIZES = ["q4_0", "q4_1", "q5_0", "q5_1"]
HEADS, DIM = 2, 64
F32 = np.float32


def padded(*values: float) -> list[float]:
    """One block of 32: values, then zeros."""
    return [*values, *[0.0] * (ref.QK - len(values))]


def random_vectors(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((24, HEADS, DIM)) * 2).astype(F32)


def outlier_vectors(seed: int = 0) -> np.ndarray:
    """Fixed large channels (as RoPE'd keys have), a vector in fp16's subnormal scales, a zero
    vector, one below iq4_nl's GROUP_MAX_EPS (1e-15), every binade from 2^-30 to 2^14."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, HEADS, DIM))
    x[:, :, [3, 17, 40]] *= [40.0, -300.0, 900.0]
    x[5] *= 1e-5
    x[6] = 0.0
    x[7, 0] = 1e-20 * rng.standard_normal(DIM)
    x[8, 1, ::2] = 1.5 * 2.0 ** rng.integers(-30, 14, DIM // 2)
    x[9, 0, ::7] = [1e4, -2e3, 600.0, -449.0, 464.0, 1e-3, -3e-7, 7e-8, 5e2, 0.01]
    return x.astype(F32)


def tie_vectors() -> np.ndarray:
    """Blocks whose values land on the types' rounding boundaries: the scale of each is exact
    (amax 127: q8_0's id is 1; max -8 / -16: q4_0's / q5_0's d is 1; range 15 / 31 from 0:
    q4_1's / q5_1's d is 1; max -127: iq4_nl's first scale is 1), then halves, levels and
    midpoints of levels; equal largest magnitudes of both signs in both orders; a constant
    block."""
    levels = ref.KVALUES_IQ4NL.astype(float)
    blocks = [
        padded(127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5, -2.5, 3.5, 64.5, -64.5),
        padded(-8.0, *np.arange(-7.5, 8.0)),
        [-16.0, *np.arange(-15.5, 15.0)],
        padded(0.0, 15.0, *np.arange(0.5, 15.0)),
        [0.0, 31.0, *np.arange(0.5, 30.0)],
        padded(-127.0, *(levels[1:] + levels[:-1]) / 2, *levels[1:]),
        padded(5.0, -5.0, 1.25, -2.5, 3.75),
        padded(-5.0, 5.0, 1.25, -2.5, 3.75),
        [3.0] * ref.QK,
        padded(-2.0, 2.0, -2.0),
        padded(-127.0, 0.5, 1.5, 2.5, -2.5, 125.5),
        padded(127.0, *(levels[1:] + levels[:-1]) / 2),
    ]
    rows = np.array(blocks).reshape(-1, HEADS, DIM)
    return np.concatenate([rows, -rows, rows * 0.75]).astype(F32)


DATA = {"random": random_vectors, "outliers": outlier_vectors, "ties": tie_vectors}


def stored_blocks(x: np.ndarray, dtype: str, kernel: bool) -> np.ndarray:
    """kvtune's codes and scales of x (Triton kernel or torch reference) as ggml's bytes."""
    fmt = KVFormat(dtype, ref.QK)
    codes, scales = (quantize if kernel else quantize_ref)(torch.from_numpy(x), fmt)
    return to_ggml_blocks(codes, scales, dtype).numpy()


def defined_bytes(x: np.ndarray, dtype: str) -> np.ndarray:
    """bool mask of the block bytes llama.cpp defines: all, except an iq4_nl block's codes where
    the block's amax is below GROUP_MAX_EPS (llama.cpp leaves them as its stack buffer was)."""
    blocks = x.reshape(-1, ref.QK)
    size = ref.BLOCK_BYTES[dtype]
    mask = np.ones((len(blocks), size), dtype=bool)
    if dtype == "iq4_nl":
        _, defined = ref.quantize_iq4_nl(blocks)
        mask[~defined, 2:] = False
    return mask.reshape(*x.shape[:-1], -1)


def test_the_registry_names_the_pinned_cache_types():
    """Every type common/arg.cpp's kv_cache_types accepts is a registered format's ggml_type;
    the quantized ones are kvtune formats of the same name whose bytes per block are ggml's."""
    named = [e.ggml_type for e in ELEMENT_FORMATS.values() if e.ggml_type is not None]
    assert sorted(named) == sorted(ref.KV_CACHE_TYPES)
    assert sorted(GGML_TYPES) == sorted(ref.BLOCK_BYTES)
    for dtype in GGML_TYPES:
        assert ELEMENT_FORMATS[dtype].ggml_type == dtype
        assert block_bytes(dtype) == ref.BLOCK_BYTES[dtype]
        assert KVFormat(dtype, ref.QK).vector_bytes(DIM) == ref.stream_bytes(dtype, DIM)


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_stored_blocks_are_llamacpps_bytes(dtype, data):
    """Codes and scales bit for bit as ggml's block bytes, by the kernel and the reference."""
    x = DATA[data]()
    expected = ref.quantize_row(x, dtype)
    mask = defined_bytes(x, dtype)
    assert mask.mean() > 0.9
    for kernel in (True, False):
        actual = stored_blocks(x, dtype, kernel)
        assert actual.shape == expected.shape
        np.testing.assert_array_equal(actual[mask], expected[mask])


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_values_read_back_are_llamacpps(dtype, data):
    """Dequantized by the Triton reader and the torch reference: ggml's dequantize_row_* of the
    same blocks, bit for bit."""
    x = torch.from_numpy(DATA[data]())
    fmt = KVFormat(dtype, ref.QK)
    codes, scales = quantize_ref(x, fmt)
    expected = ref.dequantize_row(to_ggml_blocks(codes, scales, dtype).numpy(), dtype)
    for read in (dequantize, dequantize_ref):
        np.testing.assert_array_equal(read(codes, scales, fmt, None, DIM).numpy(), expected)


@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_block_bytes_convert_both_ways(dtype):
    """kvtune's (codes, scales) -> ggml's bytes -> the same (codes, scales), and ggml's bytes
    (undefined iq4_nl codes included) -> kvtune's -> the same bytes."""
    x = np.concatenate([random_vectors(1), outlier_vectors(1), tie_vectors()])
    codes, scales = quantize_ref(torch.from_numpy(x), KVFormat(dtype, ref.QK))
    back_codes, back_scales = from_ggml_blocks(to_ggml_blocks(codes, scales, dtype), dtype)
    assert torch.equal(back_codes, codes)
    assert torch.equal(back_scales.view(torch.int16), scales.view(torch.int16))
    theirs = torch.from_numpy(ref.quantize_row(x, dtype))
    assert torch.equal(to_ggml_blocks(*from_ggml_blocks(theirs, dtype), dtype), theirs)
    their_codes, their_scales = from_ggml_blocks(theirs, dtype)
    element_codes = unpack_codes_ref(their_codes, ELEMENT_FORMATS[dtype].bits)
    np.testing.assert_array_equal(element_codes.numpy(), ref.block_codes(theirs.numpy(), dtype))
    np.testing.assert_array_equal(their_scales.numpy(), ref.block_scales(theirs.numpy(), dtype))


def gguf_type(dtype: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[dtype.upper()]


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("dtype", GGUF_QUANTIZES)
def test_gguf_quantizes_to_the_same_bytes(dtype, data):
    x = DATA[data]()
    theirs = quants.quantize(x.reshape(-1, DIM), gguf_type(dtype)).reshape(*x.shape[:-1], -1)
    np.testing.assert_array_equal(stored_blocks(x, dtype, kernel=False), theirs)


@pytest.mark.parametrize("data", sorted(DATA))
def test_q8_0_follows_llamacpps_x86_cpu_not_the_scalar_reference(data):
    """gguf-py quantizes q8_0 as ggml's scalar reference (id = 1 / d, halves away from zero);
    llama.cpp's x86 CPUs store id = 127 / amax and halves to even, and so does kvtune. The two
    agree on random and outlier data and part on exact halves."""
    x = DATA[data]()
    theirs = quants.quantize(x.reshape(-1, DIM), gguf_type("q8_0")).reshape(*x.shape[:-1], -1)
    np.testing.assert_array_equal(theirs, ref.quantize_row_with(x, ref.quantize_q8_0_scalar))
    ours = stored_blocks(x, "q8_0", kernel=False)
    np.testing.assert_array_equal(ours, ref.quantize_row(x, "q8_0"))
    codes = [ref.block_codes(b, "q8_0").view(np.int8) for b in (ours, theirs)]
    differ = codes[0] != codes[1]
    assert differ.any() == (data == "ties")
    if data == "ties":  # 2.5 in a block of amax 127: 2 on x86, 3 in the scalar reference
        assert (codes[0][0, 0, 1], codes[1][0, 0, 1]) == (2, 3)
        assert np.abs(codes[0][differ].astype(int) - codes[1][differ]).max() == 1


def reciprocal_sensitive_q8_0_vectors() -> np.ndarray:
    """Vectors [N, 1, DIM] whose first block holds an amax where 127 / amax and 1 / (amax / 127)
    are different floats, and a value x whose x * id rounds differently under the two."""
    amaxes = (F32(1) + np.arange(1, 4096, dtype=F32) * F32(2**-14)).astype(F32)
    x86, scalar = F32(127) / amaxes, F32(1) / (amaxes / F32(127))
    pairs = []
    for amax, id_x86, id_scalar in zip(amaxes, x86, scalar, strict=True):
        x = np.array([(k + 0.5) / id_x86 for k in range(1, 100)], dtype=F32)
        apart = np.rint(x * id_x86) != np.rint(x * id_scalar)
        pairs += [(amax, value) for value in x[apart]]
        if len(pairs) >= 8:
            break
    vectors = np.zeros((len(pairs), 1, DIM), dtype=F32)
    vectors[:, 0, :2] = pairs
    return vectors


def test_q8_0_multiplies_by_127_over_amax_as_the_x86_cpu_does():
    """Where 127 / amax (x86) and 1 / d (ggml's scalar path and ARM) are different floats, a
    code can differ: the kernel and the reference take the x86 one."""
    x = reciprocal_sensitive_q8_0_vectors()
    assert len(x) >= 8
    expected = ref.quantize_row(x, "q8_0")
    assert not np.array_equal(expected, ref.quantize_row_with(x, ref.quantize_q8_0_scalar))
    for kernel in (True, False):
        np.testing.assert_array_equal(stored_blocks(x, "q8_0", kernel), expected)


@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_gguf_dequantizes_what_kvtune_stores(dtype):
    x = np.concatenate([random_vectors(2), outlier_vectors(2), tie_vectors()])
    fmt = KVFormat(dtype, ref.QK)
    codes, scales = quantize_ref(torch.from_numpy(x), fmt)
    blocks = to_ggml_blocks(codes, scales, dtype).numpy()
    theirs = quants.dequantize(blocks.reshape(-1, blocks.shape[-1]), gguf_type(dtype))
    ours = dequantize_ref(codes, scales, fmt, None, DIM).numpy()
    np.testing.assert_array_equal(ours.reshape(theirs.shape), theirs)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_unquantized_types_store_what_ggml_converts(dtype):
    """f16: IEEE fp16 (round to nearest even); bf16: ggml_compute_fp32_to_bf16, as gguf-py
    copies it."""
    x = np.concatenate([random_vectors(3), outlier_vectors(3)])
    element = ELEMENT_FORMATS[dtype]
    ours = element.encode(torch.from_numpy(x)).view(torch.int16).numpy().view(np.uint8)
    qtype = {"fp16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}[dtype]
    theirs = quants.quantize(x.reshape(-1, DIM), qtype).view(np.uint8)
    np.testing.assert_array_equal(ours.reshape(theirs.shape), theirs)
    assert element.ggml_type == {"fp16": "f16", "bf16": "bf16"}[dtype]


def test_signed_zero_blocks_keep_llamacpps_sign_bits():
    """All-zero blocks: q4_0 / q5_0 take max = +0 whatever the zeros' signs, so d = -0.0
    (0x8000); the _1 types take the first zero as min and max. gguf-py takes the first zero's
    sign for q4_0, so only the numpy port judges these."""
    x = np.zeros((4, HEADS, DIM), dtype=F32)
    x[0, 0, 0] = -0.0
    x[1, 0, 1::2] = -0.0
    x[2, 1] = -0.0
    for dtype in GGML_TYPES:
        for kernel in (True, False):
            np.testing.assert_array_equal(
                stored_blocks(x, dtype, kernel)[defined_bytes(x, dtype)],
                ref.quantize_row(x, dtype)[defined_bytes(x, dtype)],
                err_msg=f"{dtype} kernel={kernel}",
            )


@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_cache_pools_hold_and_read_llamacpps_values(dtype):
    """Written into paged pools by the Triton cache write and the torch reference, read by
    `read_blocks_into` (the native CPU reader where the codes fill whole bytes) and slot by
    slot: ggml's values."""
    x = torch.from_numpy(np.concatenate([random_vectors(4), tie_vectors()])[:32])
    fmt = KVFormat(dtype, ref.QK, tensor_scale="unit")
    expected = ref.dequantize_row(ref.quantize_row(x.numpy(), dtype), dtype)
    slots = torch.arange(32).flip(0)
    for write in (write_kv, write_kv_ref):
        pools = [KVPool.allocate(fmt, 2, 16, HEADS, DIM) for _ in range(2)]
        write(x, x, slots, *pools)
        np.testing.assert_array_equal(read_vectors_ref(pools[0], slots).numpy(), expected)
        out = torch.empty(1, HEADS, 32, DIM)
        read_blocks_into(pools[1], torch.tensor([[0, 1]], dtype=torch.int32), out)
        by_slot = out[0].transpose(0, 1)[slots]
        np.testing.assert_array_equal(by_slot.numpy(), expected)


@pytest.mark.parametrize("dtype", GGML_TYPES)
def test_any_group_size_follows_the_same_rule(dtype):
    """kvtune also applies a type's rule to groups of 16 or 64 (llama.cpp's are 32): the kernel
    equals the reference there too, on a head_dim that pads the Triton tile (96)."""
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((6, HEADS, 96)).astype(F32))
    for group in (16, 32):
        fmt = KVFormat(dtype, group)
        codes, scales = quantize(x, fmt)
        codes_ref, scales_ref = quantize_ref(x, fmt)
        assert torch.equal(codes, codes_ref)
        assert torch.equal(scales.view(torch.int16), scales_ref.view(torch.int16))
        values = dequantize(codes, scales, fmt, None, 96)
        assert torch.equal(values, dequantize_ref(codes, scales, fmt, None, 96))
