"""int4 codes with the zero point inside the fp32 scale word (vLLM's int4_per_token_head):
Triton and torch against a numpy oracle written from the format's documented rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize, dequantize_ref, quantize, quantize_ref


def round_half_away(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    return np.trunc(v + np.where(v >= 0, np.float32(0.5), np.float32(-0.5))).astype(np.float32)


def oracle(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [..., D] uint8 unpacked, stored words fp32 [..., D / group], values fp32)."""
    groups = x.astype(np.float32).reshape(*x.shape[:-1], -1, group)
    low, high = groups.min(-1), groups.max(-1)
    scale = np.maximum((high - low) / np.float32(15), np.float32(1e-6)).astype(np.float32)
    zero = np.clip(round_half_away(-low / scale), 0, 15)
    units = groups * (np.float32(1) / scale)[..., None] + zero[..., None]
    codes = np.clip(round_half_away(units), 0, 15)
    cleared = scale.view(np.uint32) & np.uint32(0xFFFFFFF0)
    words = (cleared | zero.astype(np.uint32)).view(np.float32)
    values = (codes - zero[..., None]) * cleared.view(np.float32)[..., None]
    return codes.astype(np.uint8).reshape(x.shape), words, values.reshape(x.shape)


def vectors(seed: int) -> torch.Tensor:
    """Random vectors with outliers, a constant one (zero span: the 1e-6 floor), one-signed
    positive and negative ones (zero point clamped at 0 and 15), exact halfway units."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 3, 128, generator=generator) * 2
    x[0, 0, 7] = 40.0
    x[1, 1] = 0.75
    x[2, 0] = x[2, 0].abs() + 3.0
    x[3, 2] = -(x[3, 2].abs() + 3.0)
    x[4, 0] = torch.arange(128.0) % 16 - 7.5  # span 15: scale 1, zero point 8 (7.5 + 0.5)
    return x


@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_triton_and_torch_store_the_documented_codes_and_words(group):
    fmt = KVFormat("int4_zp_in_scale", group, "fp32")
    x = vectors(group)
    codes, words, values = oracle(x.numpy(), group)
    packed_expected = codes[..., 0::2] | (codes[..., 1::2] << 4)
    for quantizer, dequantizer in ((quantize, dequantize), (quantize_ref, dequantize_ref)):
        packed, stored = quantizer(x, fmt)
        np.testing.assert_array_equal(packed.numpy(), packed_expected)
        np.testing.assert_array_equal(stored.numpy().view(np.uint32), words.view(np.uint32))
        restored = dequantizer(packed, stored, fmt, None, 128)
        np.testing.assert_array_equal(restored.numpy(), values)
    assert (words.view(np.uint32) & 0xF).max() == 15 and (words.view(np.uint32) & 0xF).min() == 0


def test_error_is_half_a_step_inside_the_range_and_bytes_are_codes_plus_one_word():
    fmt = KVFormat("int4_zp_in_scale", 64, "fp32")
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(1))
    restored = dequantize(*quantize(x, fmt), fmt, None, 64)
    step = (x.amax(-1) - x.amin(-1)) / 15
    assert ((restored - x).abs() <= step[:, None] * (0.5 + 1e-4) + 1e-6).all()
    assert fmt.vector_bytes(64) == 64 // 2 + 4 and fmt.vector_bytes(128) == 64 + 8


def test_needs_an_fp32_scale_word_and_a_group():
    with pytest.raises(ValueError, match="scale_dtype='fp16': int4_zp_in_scale"):
        KVFormat("int4_zp_in_scale", 64)
    with pytest.raises(ValueError, match="group_size=None: int4_zp_in_scale"):
        KVFormat("int4_zp_in_scale", None, "fp32")
