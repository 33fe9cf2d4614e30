"""FP8 E4M3 / FP4 E2M1 codes against torch.float8_e4m3fn and ml_dtypes.float4_e2m1fn."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvtune.kernels.formats.fp_codes import (
    decode_e2m1,
    decode_e2m1_ref,
    decode_e4m3,
    decode_e4m3_fast,
    decode_e4m3_ref,
    decode_packed_e2m1_fast,
    encode_e2m1,
    encode_e2m1_fast,
    encode_e2m1_ref,
    encode_e4m3,
    encode_e4m3_fast,
    encode_e4m3_ref,
    pack_e2m1_ref,
    round_to_bf16,
    unpack_e2m1_ref,
)

BLOCK = 4096


@triton.jit
def _apply_kernel(src_ptr, dst_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, FN(tl.load(src_ptr + offsets, mask=mask)), mask=mask)


def _apply(fn, src: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Run one device function elementwise over a flat buffer."""
    dst = torch.empty(src.numel(), dtype=out_dtype)
    _apply_kernel[(triton.cdiv(src.numel(), BLOCK),)](src, dst, src.numel(), FN=fn, BLOCK=BLOCK)
    return dst


def _with_neighbours(points: torch.Tensor) -> torch.Tensor:
    """Each point, the next fp32 value above and below it, with both signs."""
    points = points.to(torch.float32)
    up = torch.nextafter(points, torch.full_like(points, torch.inf))
    down = torch.nextafter(points, torch.zeros_like(points))
    around = torch.cat((points, up, down))
    return torch.cat((around, -around))


def _e4m3_inputs() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (values[1:] + values[:-1]) / 2  # exact ties, for round-to-nearest-even
    scattered = torch.randn(4000, generator=generator) * torch.exp2(
        torch.randint(-14, 11, (4000,), generator=generator).float()
    )
    special = torch.tensor(
        [
            0.0,
            2.0**-6,
            2.0**-9,
            2.0**-10,
            3 * 2.0**-11,
            1e-40,
            1e-45,
            2.0**-126,
            448.0,
            449.0,
            464.0,
            480.0,
            1e6,
            3.4e38,
            torch.inf,
        ]
    )
    return torch.cat((_with_neighbours(torch.cat((values, midpoints, special))), scattered))


def _e2m1_inputs() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    midpoints = (values[1:] + values[:-1]) / 2
    scattered = torch.randn(4000, generator=generator) * 3
    special = torch.tensor([0.0, 0.125, 1e-40, 1e-45, 6.5, 7.0, 100.0, 3.4e38, torch.inf])
    return torch.cat((_with_neighbours(torch.cat((values, midpoints, special))), scattered))


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _ml_dtypes_e2m1(x: torch.Tensor) -> torch.Tensor:
    # ml_dtypes already saturates finite overflow; clamping states the intended rule explicitly.
    clamped = np.clip(x.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return torch.from_numpy(clamped.view(np.uint8).copy())


def test_e4m3_inputs_cover_ties_subnormals_and_signed_zero() -> None:
    x = _e4m3_inputs()
    assert (x == 2.0**-10).any() and torch.signbit(x[x == 0]).any()
    assert ((x.abs() > 448) & torch.isinf(x)).any()


@pytest.mark.parametrize("encode", [encode_e4m3_ref, "triton"])
def test_encode_e4m3_bit_exact_with_torch(encode) -> None:
    x = _e4m3_inputs()
    codes = encode(x) if callable(encode) else _apply(encode_e4m3, x, torch.uint8)
    expected = _torch_e4m3(x)
    mismatch = codes != expected
    assert not mismatch.any(), (x[mismatch][:8], codes[mismatch][:8], expected[mismatch][:8])


@pytest.mark.parametrize("encode", [encode_e4m3_ref, "triton"])
def test_encode_e4m3_nan_maps_to_nan_code(encode) -> None:
    x = torch.tensor([torch.nan, -torch.nan])
    codes = encode(x) if callable(encode) else _apply(encode_e4m3, x, torch.uint8)
    assert ((codes & 0x7F) == 0x7F).all()


@pytest.mark.parametrize("decode", [decode_e4m3_ref, "triton"])
def test_decode_e4m3_all_codes(decode) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    values = decode(codes) if callable(decode) else _apply(decode_e4m3, codes, torch.float32)
    expected = codes.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(values, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(values), torch.signbit(expected))


@pytest.mark.parametrize("encode", [encode_e2m1_ref, "triton"])
def test_encode_e2m1_bit_exact_with_ml_dtypes(encode) -> None:
    x = _e2m1_inputs()
    codes = encode(x) if callable(encode) else _apply(encode_e2m1, x, torch.uint8)
    expected = _ml_dtypes_e2m1(x)
    mismatch = codes != expected
    assert not mismatch.any(), (x[mismatch][:8], codes[mismatch][:8], expected[mismatch][:8])


@pytest.mark.parametrize("decode", [decode_e2m1_ref, "triton"])
def test_decode_e2m1_all_codes(decode) -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode(codes) if callable(decode) else _apply(decode_e2m1, codes, torch.float32)
    expected = torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    torch.testing.assert_close(values, expected, rtol=0, atol=0)
    assert torch.equal(torch.signbit(values), torch.signbit(expected))


@pytest.mark.parametrize("encode", [encode_e2m1_ref, "triton"])
def test_encode_e2m1_saturates_nan(encode) -> None:
    x = torch.tensor([torch.nan, -torch.nan])
    codes = encode(x) if callable(encode) else _apply(encode_e2m1, x, torch.uint8)
    assert torch.equal(codes & 0x7, torch.tensor([7, 7], dtype=torch.uint8))


def test_pack_e2m1_puts_even_elements_in_low_nibble() -> None:
    nibbles = torch.tensor([[0x1, 0x2, 0x3, 0xF]], dtype=torch.uint8)
    assert torch.equal(pack_e2m1_ref(nibbles), torch.tensor([[0x21, 0xF3]], dtype=torch.uint8))


def test_pack_unpack_e2m1_round_trip() -> None:
    nibbles = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_e2m1_ref(nibbles)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_e2m1_ref(packed), nibbles)


def test_pack_e2m1_rejects_odd_length() -> None:
    with pytest.raises(ValueError, match="even"):
        pack_e2m1_ref(torch.zeros(3, dtype=torch.uint8))


def test_round_to_bf16_bit_exact_with_torch() -> None:
    generator = torch.Generator().manual_seed(2)
    bf16_values = torch.randn(2000, generator=generator).bfloat16().float()
    ulp = torch.nextafter(bf16_values.bfloat16(), torch.tensor(torch.inf).bfloat16()).float()
    ties = (bf16_values + ulp) / 2  # exact midpoints between neighbouring bf16 values
    special = torch.tensor([0.0, 1e-40, 3.3895e38, 3.4e38, torch.inf, 1.0 + 2.0**-8])
    x = torch.cat((_with_neighbours(torch.cat((ties, special))), torch.randn(2000)))
    result = _apply(round_to_bf16, x, torch.bfloat16)
    expected = x.bfloat16()
    assert torch.equal(result.view(torch.int16), expected.view(torch.int16))
    assert torch.isnan(_apply(round_to_bf16, torch.tensor([torch.nan]), torch.bfloat16)).all()


@pytest.mark.parametrize(
    ("fast", "ref", "inputs"),
    [
        (encode_e4m3_fast, encode_e4m3_ref, _e4m3_inputs),
        (encode_e2m1_fast, encode_e2m1_ref, _e2m1_inputs),
    ],
)
def test_fast_encoders_equal_the_references_bit_for_bit(fast, ref, inputs):
    x = torch.cat((inputs(), torch.tensor([torch.nan, -torch.nan, -0.0])))
    assert torch.equal(fast(x), ref(x))
    assert torch.equal(fast(x.bfloat16()), ref(x.bfloat16()))


def test_fast_decoders_equal_the_references_on_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    fast, ref = decode_e4m3_fast(codes), decode_e4m3_ref(codes)
    assert torch.equal(fast.isnan(), ref.isnan())
    assert torch.equal(fast[~ref.isnan()].view(torch.int32), ref[~ref.isnan()].view(torch.int32))
    strided = codes[:120].reshape(8, 15).t()  # non-contiguous, no NaN code: keeps its shape
    assert torch.equal(decode_e4m3_fast(strided), decode_e4m3_ref(strided))
    packed = codes.reshape(4, 64)
    expected = decode_e2m1_ref(unpack_e2m1_ref(packed))
    assert torch.equal(
        decode_packed_e2m1_fast(packed).view(torch.int32), expected.view(torch.int32)
    )
