"""vLLM TurboQuant's element formats as kvtune formats: lloyd4 / lloyd3 (Lloyd-Max levels of the
unit vector, fp16 norm, norm-corrected reads; kvtune adds lloyd2) and int4_tq / int3_tq (values
coded from the fp32 range, halves up, fp16 scale and zero point). Triton vs torch reference bit
for bit, and both
against the definitions re-implemented here in numpy, with the codebook from the independent
solver of tests/kernels/formats/engine_formats_ref.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.lloyd_max import levels
from kvtune.kernels.formats.quantize import dequantize, quantize, quantize_ref
from tests.kernels.formats import engine_formats_ref as ref
from tests.kernels.formats.test_int_formats import _unpack
from tests.kernels.formats.test_quantize import assert_dequantize_matches_reference

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = {"lloyd4": 4, "lloyd3": 3, "lloyd2": 2, "int4_tq": 4, "int3_tq": 3}


def _vectors(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Offsets, outlier channels, an all-zero and a constant vector."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2 + torch.randn(*shape[:-1], 1) * 3
    x = torch.where(torch.rand(shape, generator=generator) < 0.02, x * 40, x)
    flat = x.view(-1, shape[-1])
    flat[0], flat[1] = 0.0, 0.3
    return x.to(dtype)


CASES = [
    (KVFormat(dtype, group), head_dim)
    for dtype in ("lloyd4", "lloyd3", "lloyd2")
    for head_dim, group in ((64, 64), (128, 128), (32, 32))
] + [
    (KVFormat(dtype, group), head_dim)
    for dtype in ("int4_tq", "int3_tq")
    for head_dim in (64, 96, 128)
    for group in (16, 32, 64, 128)
    if head_dim % group == 0
]


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize(("fmt", "head_dim"), CASES, ids=str)
def test_triton_matches_reference_bit_exact(fmt: KVFormat, head_dim: int, dtype) -> None:
    x = _vectors((3, 5, head_dim), dtype)
    tensor_scale = torch.tensor([0.75])
    codes, scales = quantize(x, fmt, tensor_scale)
    codes_ref, scales_ref = quantize_ref(x, fmt, tensor_scale)
    assert codes.shape == (3, 5, head_dim * BITS[fmt.dtype] // 8)
    assert torch.equal(codes, codes_ref)
    assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    assert_dequantize_matches_reference(codes, scales, fmt, tensor_scale, head_dim)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_is_the_documented_lloyd_max_solution(bits: int, head_dim: int) -> None:
    expected = ref.lloyd_max_gaussian(head_dim, bits)[0].astype(np.float32)
    np.testing.assert_array_equal(levels(head_dim, bits).numpy(), expected)


@pytest.mark.parametrize("dtype", ["lloyd4", "lloyd3", "lloyd2"])
def test_lloyd_codes_are_nearest_levels_of_the_unit_vector(dtype: str) -> None:
    """Stored scale = fp16(||x||) (norm in fp64, rounded to fp32, then fp16); code = the level
    nearest to x_i / (||x|| + 1e-8) by exhaustive search, a tie to the upper level (the zero
    vector sits on the middle boundary); read = fp16 norm * level / ||levels||
    of the vector (norm correction: the read vector has the stored norm)."""
    bits, head_dim = BITS[dtype], 64
    fmt = KVFormat(dtype, head_dim)
    x = _vectors((40, head_dim), torch.float32, seed=3)
    codes, scales = quantize(x, fmt)
    x64 = x.numpy().astype(np.float64)
    norm = np.sqrt((x64**2).sum(-1)).astype(np.float32)
    np.testing.assert_array_equal(scales.numpy()[:, 0], norm.astype(np.float16))
    unit = x.numpy() / (norm + np.float32(1e-8))[:, None]
    grid = ref.lloyd_max_gaussian(head_dim, bits)[0].astype(np.float32)
    distance = np.abs(unit[..., None].astype(np.float64) - grid)
    nearest = len(grid) - 1 - distance[..., ::-1].argmin(-1)
    np.testing.assert_array_equal(_unpack(codes.numpy(), bits), nearest)
    values = dequantize(codes, scales, fmt, None, head_dim).numpy()
    chosen = grid[nearest].astype(np.float64)
    expected = chosen / np.sqrt((chosen**2).sum(-1, keepdims=True) + 1e-16)
    expected *= scales.numpy().astype(np.float64)
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)
    read_norms = np.sqrt((values.astype(np.float64) ** 2).sum(-1))
    np.testing.assert_allclose(read_norms, scales.numpy()[:, 0].astype(np.float64), rtol=1e-6)


# Max (1960), "Quantizing for minimum distortion": the least mean squared error of a 2^bits-level
# quantizer of a unit Gaussian.
MAX_1960_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_codes_reach_the_optimal_gaussian_error(bits: int) -> None:
    """Coordinates of random unit-variance vectors (what rotated keys look like) come back with
    Max's optimal mean squared error (within sampling noise and the norm correction)."""
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    fmt = KVFormat(f"lloyd{bits}", 64)
    restored = dequantize(*quantize(x, fmt), fmt, None, 64)
    error = float(((restored - x) ** 2).mean())
    assert abs(error / MAX_1960_MSE[bits] - 1) < 0.1


def test_whole_vector_formats_refuse_other_groups_and_channel_blocks() -> None:
    with pytest.raises(ValueError, match="group_size=head_dim=64"):
        KVFormat("lloyd4", 32).check_head_dim(64)
    with pytest.raises(ValueError, match="codes whole vectors"):
        KVFormat("lloyd3", 1, token_group=16)
    with pytest.raises(ValueError, match="multiple of 8"):
        KVFormat("int3_tq", 4).check_head_dim(36)
