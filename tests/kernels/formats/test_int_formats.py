"""Asymmetric uniform integer formats (int8, int4, int3, int2): Triton vs torch reference bit for
bit, and both vs a numpy re-implementation of the format's definition (nearest grid point by
exhaustive search, ties to the even code; scale and zero point per group in fp16; codes packed
little end first in one bit stream per vector)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvtune.kernels.formats.int_codes import decode_codes_fast
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize, quantize, quantize_ref
from tests.kernels.formats.test_quantize import assert_dequantize_matches_reference

BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vectors(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """K/V-like vectors: a per-vector offset (asymmetric groups), outliers, a constant vector
    and an all-zero vector (groups with scale 0)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2
    x = x + torch.randn(*shape[:-1], 1, generator=generator) * 3
    outliers = torch.rand(shape, generator=generator) < 0.02
    x = torch.where(outliers, x * 40, x)
    flat = x.view(-1, shape[-1])
    flat[0] = 0.0
    flat[1] = 0.3
    return x.to(dtype)


def _cases(head_dims: tuple[int, ...]) -> list[tuple[KVFormat, int]]:
    return [
        (KVFormat(dtype, group), head_dim)
        for dtype, group, head_dim in itertools.product(BITS, (16, 32, 64, 128), head_dims)
        if head_dim % group == 0
    ]


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize(("fmt", "head_dim"), _cases((64, 128, 96)), ids=str)
def test_triton_matches_reference_bit_exact(fmt: KVFormat, head_dim: int, dtype) -> None:
    x = _vectors((3, 5, head_dim), dtype)
    tensor_scale = torch.tensor([0.75])
    codes, scales = quantize(x, fmt, tensor_scale)
    codes_ref, scales_ref = quantize_ref(x, fmt, tensor_scale)
    assert codes.shape == (3, 5, head_dim * BITS[fmt.dtype] // 8) and codes.dtype == torch.uint8
    assert scales.shape == (3, 5, 2 * head_dim // fmt.group_size)
    assert scales.dtype == torch.float16
    assert torch.equal(codes, codes_ref)
    assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    assert_dequantize_matches_reference(codes, scales, fmt, tensor_scale, head_dim)


def _nearest_code(u: np.ndarray, top: int) -> np.ndarray:
    """Nearest integer grid point 0..top of each u by exhaustive search, ties to the even one."""
    grid = np.arange(top + 1, dtype=np.float64)
    distance = np.abs(u.astype(np.float64)[..., None] - grid)
    best = distance.min(axis=-1, keepdims=True)
    is_best = distance == best
    # Among equally near grid points (a tie), prefer the even one.
    preference = np.where(is_best, np.where(grid % 2 == 0, 2, 1), 0)
    return preference.argmax(axis=-1)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Element i of a vector is bits [i * bits, (i + 1) * bits) of its bytes read as one
    little-endian bit stream (numpy's unpackbits, least significant bit first)."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    fields = stream.reshape(*packed.shape[:-1], -1, bits).astype(np.int64)
    return (fields << np.arange(bits)).sum(-1)


@pytest.mark.parametrize(("fmt", "head_dim"), _cases((64, 96)), ids=str)
def test_codes_follow_the_definition(fmt: KVFormat, head_dim: int) -> None:
    """z = fp16(min), s = fp16((max - z) / (2^bits - 1)), code = nearest grid point of
    (x - z) / s clamped to the code range, value = code * s + z, all in tensor-scaled units."""
    bits, group = BITS[fmt.dtype], fmt.group_size
    top = 2**bits - 1
    x = _vectors((9, head_dim), torch.float32, seed=3)
    tensor_scale = np.float32(0.75)
    codes, scales = quantize(x, fmt, torch.tensor([float(tensor_scale)]))

    scaled = (x.numpy() / tensor_scale).astype(np.float32).reshape(9, -1, group)
    zero = scaled.min(axis=-1).astype(np.float16)
    span = np.maximum(scaled.max(axis=-1) - zero.astype(np.float32), np.float32(0))
    scale = (span / np.float32(top)).astype(np.float16)
    assert np.array_equal(
        scales.numpy().view(np.uint16), np.concatenate((scale, zero), -1).view(np.uint16)
    )

    s32, z32 = scale.astype(np.float32)[..., None], zero.astype(np.float32)[..., None]
    u = (scaled - z32) / np.where(s32 == 0, np.float32(1), s32)
    expected_codes = np.where(s32 == 0, 0, _nearest_code(u, top)).reshape(9, head_dim)
    assert np.array_equal(_unpack(codes.numpy(), bits), expected_codes)

    values = dequantize(codes, scales, fmt, torch.tensor([float(tensor_scale)]), head_dim)
    grid_values = expected_codes.reshape(9, -1, group).astype(np.float32) * s32 + z32
    assert np.array_equal(values.numpy(), grid_values.reshape(9, head_dim) * tensor_scale)


@pytest.mark.parametrize("group", [16, 32, 128])
def test_round_trip_error_is_half_a_step_and_shrinks_with_bits(group: int) -> None:
    """Each element comes back within half a grid step s_g (plus the fp16 rounding of the zero
    point and of the scale at the top of the range); more bits, smaller error."""
    x = _vectors((16, 128), torch.float32, seed=4)
    mean_errors = []
    for dtype in ("int2", "int3", "int4", "int8"):
        fmt = KVFormat(dtype, group)
        codes, scales = quantize(x, fmt)
        error = (dequantize(codes, scales, fmt, None, 128) - x).abs().unflatten(-1, (-1, group))
        groups = 128 // group
        scale, zero = scales[:, :groups].float(), scales[:, groups:].float()
        low = x.unflatten(-1, (-1, group)).amin(-1)
        bound = scale / 2 + (low - zero).abs() + fmt.max_code * scale * 2.0**-11
        assert (error <= bound[..., None] * (1 + 1e-6)).all(), fmt
        mean_errors.append(error.mean().item())
    int2, int3, int4, int8 = mean_errors
    assert int2 > 1.3 * int3 and int3 > 1.3 * int4 and int4 > 8 * int8 > 0


def test_constant_and_zero_groups_store_scale_zero() -> None:
    fmt = KVFormat("int4", 16)
    x = torch.zeros(2, 32)
    x[1, :16] = 0.3
    codes, scales = quantize(x, fmt)
    assert torch.equal(codes, torch.zeros_like(codes))
    assert torch.equal(scales[:, :2], torch.zeros(2, 2, dtype=torch.float16))
    assert scales[1, 2] == torch.tensor(0.3, dtype=torch.float16) and scales[0, 2] == 0
    expected = x.half().float()
    assert torch.equal(dequantize(codes, scales, fmt, None, 32), expected)


@pytest.mark.parametrize(
    ("dtype", "expected_bytes"),
    [
        ("int4", [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]),
        ("int2", [0xE4, 0xE4, 0xE4, 0xE4]),
        # Eight 3-bit codes 0..7 form the 24-bit word sum(i << 3i) = 0xFAC688, low byte first.
        ("int3", [0x88, 0xC6, 0xFA, 0x88, 0xC6, 0xFA]),
        ("int8", [*range(15), 255]),
    ],
)
def test_codes_are_packed_little_end_first(dtype: str, expected_bytes: list[int]) -> None:
    """Values on the grid itself (zero point 0, scale 1, code = value): x_i = i mod 2^bits, the
    last int8 element 255; int4 puts element 2i in the low nibble, int2 element 4i in the
    lowest two bits, int3 eight elements in three bytes."""
    top = 2 ** BITS[dtype] - 1
    x = (torch.arange(16) % (top + 1)).float()[None]
    x[0, -1] = top
    fmt = KVFormat(dtype, 16)
    for codes, scales in (quantize(x, fmt), quantize_ref(x, fmt)):
        assert codes[0].tolist() == expected_bytes
        assert scales[0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_fast_decode_reads_the_bit_stream(bits: int) -> None:
    """decode_codes_fast (the torch backend's hot path) against the packing rule read off
    numpy bits: element i of a vector is bits [i * bits, (i + 1) * bits) of its bytes, least
    significant first; on every byte value, on a strided view and on no vectors."""
    generator = np.random.default_rng(bits)
    packed = generator.integers(0, 256, size=(5, 7, 24), dtype=np.uint8)
    packed.reshape(-1)[:256] = np.arange(256)
    bit_stream = np.unpackbits(packed, axis=-1, bitorder="little").reshape(5, 7, -1, bits)
    expected = (bit_stream * (1 << np.arange(bits))).sum(-1).astype(np.float32)
    decoded = decode_codes_fast(torch.from_numpy(packed), bits)
    assert decoded.dtype == torch.float32
    np.testing.assert_array_equal(decoded.numpy(), expected)
    strided = torch.from_numpy(packed).transpose(0, 1)[:, ::2]
    np.testing.assert_array_equal(
        decode_codes_fast(strided, bits).numpy(), expected.transpose(1, 0, 2)[:, ::2]
    )
    empty = decode_codes_fast(torch.zeros(0, 2, 24, dtype=torch.uint8), bits)
    assert empty.shape == (0, 2, 24 * 8 // bits)
