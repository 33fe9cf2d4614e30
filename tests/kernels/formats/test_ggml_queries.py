"""Queries meeting a llama.cpp K type are rounded as llama.cpp's x86 CPU quantizes them to q8_0
before q.k: checked bit for bit against the numpy port of ggml's quantize_row_q8_0 (AVX2) and
dequantize_row_q8_0, on random rows, an all-zero block and exact halves (ties to even)."""

from __future__ import annotations

import numpy as np
import torch

from kvtune.kernels.formats.ggml_queries import round_queries
from tests.kernels.formats import llamacpp_formats_ref as llamacpp


def _reference(q: torch.Tensor) -> torch.Tensor:
    blocks = llamacpp.quantize_row(q.numpy(), "q8_0")
    return torch.from_numpy(llamacpp.dequantize_row(blocks, "q8_0"))


def test_queries_round_as_ggml_q8_0_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 9, 64, generator=generator) * torch.logspace(-3, 2, 64)
    q[0, 0, :32] = 0.0  # a block of zeros keeps d = 0
    q[1, 0, :32] = torch.arange(32) - 15.5  # 127 / 16.5 * x lands on halves: ties to even
    rounded = round_queries(q)
    expected = _reference(q)
    assert rounded.dtype == q.dtype
    assert torch.equal(rounded, expected)
    assert not torch.equal(rounded, q)


def test_rounding_follows_blocks_of_32_along_head_dim():
    """One outlier sets only its own block's scale: the other block keeps its precision."""
    q = torch.full((1, 1, 64), 0.01)
    q[0, 0, 0] = 100.0
    rounded = round_queries(q)
    assert torch.equal(rounded[..., 32:], _reference(q)[..., 32:])
    assert torch.allclose(rounded[..., 32:], q[..., 32:], rtol=1e-2)
    assert np.all(rounded[0, 0, 1:32].numpy() == 0.0)  # 0.01 is under half a code of 100 / 127
