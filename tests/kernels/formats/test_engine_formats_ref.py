"""The engine-format references checked against facts that do not come from them.

Oracles: ml_dtypes' element tables and casts (E2M1, E4M3, E5M2, E8M0, bf16), scipy's Hadamard
matrix, closed-form Gaussian integrals and J. Max's published Lloyd-Max quantizers (IEEE Trans.
Inf. Theory, 1960), the byte formulas of docs/engine_formats.md, and error bounds that follow
from each format's definition.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg

from tests.kernels.formats import engine_formats_ref as ref

RNG_SEED = 20261202
HEAD_DIMS = (64, 128)


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def _keys(shape: tuple[int, ...], outlier_channels: int = 2) -> np.ndarray:
    """Gaussian vectors with a few large fixed channels, like post-RoPE keys."""
    x = _rng().standard_normal(shape).astype(np.float32)
    x[..., :outlier_channels] *= 12.0
    return x


def _ml_cast(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float64)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Element 2i from the low nibble, 2i+1 from the high nibble (the documented order)."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


# --- element formats -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "ml_dtype", "count"),
    [
        (ref.E2M1, ml_dtypes.float4_e2m1fn, 16),
        (ref.E4M3, ml_dtypes.float8_e4m3fn, 256),
        (ref.E5M2, ml_dtypes.float8_e5m2, 256),
    ],
)
def test_element_code_tables_match_ml_dtypes(fmt, ml_dtype, count):
    codes = np.arange(count, dtype=np.uint8)
    expected = codes.view(ml_dtype).astype(np.float64)
    np.testing.assert_array_equal(fmt.decode(codes), expected)
    assert fmt.max_value == float(ml_dtypes.finfo(ml_dtype).max)


def test_ue8m0_scale_bytes_match_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(ref.decode_ue8m0(codes), expected)


@pytest.mark.parametrize(
    ("fmt", "ml_dtype"),
    [
        (ref.E2M1, ml_dtypes.float4_e2m1fn),
        (ref.E4M3, ml_dtypes.float8_e4m3fn),
        (ref.E5M2, ml_dtypes.float8_e5m2),
    ],
)
def test_round_to_nearest_even_saturating_matches_ml_dtypes(fmt, ml_dtype):
    grid = fmt.magnitudes
    ties = (grid[1:] + grid[:-1]) / 2
    scattered = _rng().standard_normal(4000) * np.exp2(_rng().uniform(-12, 12, 4000))
    beyond = np.array([fmt.max_value * 1.01, fmt.max_value * 7.0])
    values = np.concatenate([grid, ties, scattered, beyond])
    values = np.concatenate([values, -values]).astype(np.float32)
    clipped = np.clip(values, -fmt.max_value, fmt.max_value)
    np.testing.assert_array_equal(fmt.decode(fmt.encode(values)), _ml_cast(clipped, ml_dtype))


def test_lsb_first_packing_order():
    assert ref.pack_lsb_first(np.array([1, 2], np.uint8), 4).tolist() == [0x21]
    # 8 three-bit codes 0..7 form the 24-bit word sum(i << 3i) = 0xFAC688, little-endian.
    assert ref.pack_lsb_first(np.arange(8, dtype=np.uint8), 3).tolist() == [0x88, 0xC6, 0xFA]
    codes = _rng().integers(0, 8, size=(5, 64)).astype(np.uint8)
    np.testing.assert_array_equal(ref.unpack_lsb_first(ref.pack_lsb_first(codes, 3), 3, 64), codes)


# --- FP8 with one scale per tensor -------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "ml_dtype"), [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)]
)
def test_fp8_per_tensor_is_saturating_cast_of_x_over_scale(fmt, ml_dtype):
    x = _keys((16, 128)) * 40.0
    scale = 0.37
    codes = ref.encode_fp8_per_tensor(x, scale, fmt)
    assert codes.dtype == np.uint8 and codes.shape == x.shape
    limit = float(ml_dtypes.finfo(ml_dtype).max)
    quotient = np.clip(x.astype(np.float32) / np.float32(scale), -limit, limit)
    np.testing.assert_array_equal(
        codes.view(ml_dtype).astype(np.float64), _ml_cast(quotient, ml_dtype)
    )
    decoded = ref.decode_fp8_per_tensor(codes, scale, fmt)
    np.testing.assert_allclose(decoded, _ml_cast(quotient, ml_dtype) * scale, rtol=1e-6)


def test_sglang_fp8_rounds_quotient_to_bf16_first_and_e5m2_overflows_to_inf():
    x = _keys((8, 64))
    scale = 0.011
    codes = ref.encode_fp8_per_tensor_sglang(x, scale, "e4m3")
    quotient_bf16 = (x / np.float32(scale)).astype(ml_dtypes.bfloat16).astype(np.float32)
    expected = _ml_cast(np.clip(quotient_bf16, -448, 448), ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), expected)
    big = np.array([61439.0, 61440.0, -70000.0], np.float32)
    decoded = ref.E5M2.decode(ref.encode_fp8_per_tensor_sglang(big, None, "e5m2"))
    np.testing.assert_array_equal(decoded, [57344.0, np.inf, -np.inf])


# --- per-token-head int8 / fp8 -----------------------------------------------------------------


def test_int8_per_token_head_scale_rounding_and_error():
    x = _keys((32, 4, 128))
    codes, scale = ref.encode_per_token_head(x, "int8")
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(scale, amax / 127.0, rtol=1e-6)
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    assert np.all(np.abs(codes.astype(np.int64)).max(-1) == 127)
    error = np.abs(ref.decode_per_token_head(codes, scale, "int8") - x)
    assert np.all(error <= scale[..., None] * (0.5 + 1e-5))
    # The kernel's idiom: halfway cases round away from zero (2.5 -> 3, -2.5 -> -3).
    tie_codes, tie_scale = ref.encode_per_token_head(np.array([[127.0, 2.5, -2.5, 0.5]]), "int8")
    assert tie_scale[0] == 1.0 and tie_codes[0].tolist() == [127, 3, -3, 1]


def test_per_token_head_zero_vector_uses_scale_floor():
    codes, scale = ref.encode_per_token_head(np.zeros((2, 64), np.float32), "int8")
    assert np.all(codes == 0) and np.all(scale == np.float32(1e-6))


def test_fp8_per_token_head_maps_amax_to_448():
    x = _keys((32, 4, 128))
    codes, scale = ref.encode_per_token_head(x, "fp8")
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / 448.0, rtol=1e-6)
    decoded_codes = ref.E4M3.decode(codes)
    np.testing.assert_allclose(np.abs(decoded_codes).max(-1), 448.0, rtol=0, atol=0)
    quotient = x * (np.float32(1) / scale)[..., None]
    expected = _ml_cast(np.clip(quotient, -448, 448), ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(decoded_codes, expected)
    decoded = ref.decode_per_token_head(codes, scale, "fp8")
    normal = np.abs(quotient) >= 2.0**-6  # E4M3 normal range: relative step 2^-3
    relative = np.abs(decoded - x)[normal] / np.abs(x)[normal]
    assert relative.max() <= 2.0**-4 * (1 + 1e-5)


# --- int4 per token-head with randomized Hadamard rotation ------------------------------------


@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_sylvester_hadamard_matches_scipy(n):
    np.testing.assert_array_equal(ref.sylvester_hadamard(n), scipy.linalg.hadamard(n))


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rht_is_scaled_orthogonal_and_block_diagonal(head_dim):
    block = ref.largest_pow2_divisor(head_dim)
    signs = ref.rht_signs(block)
    assert set(np.unique(signs).tolist()) <= {-1.0, 1.0} and signs.shape == (block,)
    x = _keys((10, head_dim)).astype(np.float64)
    y = ref.rht(x)
    np.testing.assert_allclose(
        np.linalg.norm(y, axis=-1), math.sqrt(block) * np.linalg.norm(x, axis=-1)
    )
    np.testing.assert_allclose(ref.rht(y, inverse=True) / block, x, atol=1e-12)
    expected_first_block = scipy.linalg.hadamard(block) @ (signs * x[:, :block]).T
    np.testing.assert_allclose(y[:, :block], expected_first_block.T, atol=1e-12)
    if block < head_dim:  # a vector confined to the first block stays there
        confined = np.zeros(head_dim)
        confined[:block] = x[0, :block]
        assert np.all(ref.rht(confined)[block:] == 0)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_int4_per_token_head_round_trip(head_dim):
    x = _keys((64, 2, head_dim))
    packed, word = ref.encode_int4_per_token_head(x, model_dtype="bfloat16")
    assert packed.dtype == np.uint8 and packed.shape == (64, 2, head_dim // 2)
    assert word.dtype == np.float32 and word.shape == (64, 2)
    scale, zero_point = ref.split_int4_scale_word(word)
    assert np.all((word.view(np.uint32) & 0xF) == zero_point.astype(np.uint32))
    block = ref.largest_pow2_divisor(head_dim)
    rotated = ref.rht(x).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    y_min, y_max = rotated.min(-1), rotated.max(-1)
    np.testing.assert_allclose(scale, (y_max - y_min) / 15, rtol=1e-5)
    np.testing.assert_array_equal(zero_point, np.clip(np.round(-y_min / scale), 0, 15))
    # Within [min, max] the codes reach both ends only when min <= 0 <= max: the zero point
    # is clamped to [0, 15] (see the one-signed test below).
    straddles = (y_min < 0) & (y_max > 0)
    assert straddles.mean() > 0.5
    error = np.abs(ref.decode_int4_rotated(packed, word) - rotated)
    assert np.all(error[straddles] <= scale[straddles][..., None] * (0.5 + 1e-4))
    restored = ref.decode_int4_per_token_head(packed, word)
    norm_error = np.linalg.norm(restored - x, axis=-1)
    rotated_error = np.linalg.norm(ref.decode_int4_rotated(packed, word) - ref.rht(x), axis=-1)
    np.testing.assert_allclose(norm_error, rotated_error / math.sqrt(block), rtol=1e-4, atol=1e-6)
    nibbles = _unpack_nibbles(packed).astype(np.float64)
    manual = (nibbles - zero_point[..., None]) * scale[..., None]
    np.testing.assert_allclose(ref.decode_int4_rotated(packed, word), manual)


def test_int4_one_signed_rotated_vector_clamps_zero_point():
    # The first Hadamard column is all ones, so channel 0 adds the same offset to every rotated
    # coordinate; a large channel 0 makes the rotated vector one-signed, zp clamps to 0 and the
    # top codes saturate at 15.
    x = _rng().standard_normal((4, 128)).astype(np.float32) * 0.1
    x[:, 0] = 10.0 * ref.rht_signs(128)[0]
    packed, word = ref.encode_int4_per_token_head(x, model_dtype=None)
    rotated = ref.rht(x)
    assert np.all(rotated.min(-1) > 0)
    scale, zero_point = ref.split_int4_scale_word(word)
    assert np.all(zero_point == 0)
    assert np.all(_unpack_nibbles(packed).max(-1) == 15)
    error = np.abs(ref.decode_int4_rotated(packed, word) - rotated).max(-1)
    assert np.all(error > 0.5 * rotated.min(-1))


# --- NVFP4 and 4over6 --------------------------------------------------------------------------


def _decode_nvfp4_with_ml_dtypes(packed, scale_bytes, global_scale):
    elements = _unpack_nibbles(packed).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scales = scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    blocks = elements.reshape(*elements.shape[:-1], -1, 16) * scales[..., None] * global_scale
    return blocks.reshape(elements.shape)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("calibrated", [False, True])
def test_nvfp4_layout_scales_and_error_bound(head_dim, calibrated):
    x = _keys((32, 4, head_dim))
    # A calibrated global scale maps the tensor's amax to the largest E4M3 x E2M1 product.
    global_scale = float(np.abs(x).max() / (6 * 448)) if calibrated else 1.0
    packed, scale_bytes = ref.encode_nvfp4(x, global_scale)
    assert packed.shape[-1] + scale_bytes.shape[-1] == head_dim // 2 + head_dim // 16
    assert packed.dtype == np.uint8 and scale_bytes.dtype == np.uint8
    amax = np.abs(x.reshape(*x.shape[:-1], -1, 16)).max(-1)
    g = np.float32(global_scale)
    expected_scales = _ml_cast(np.clip(amax / np.float32(6) / g, 0, 448), ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(
        scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), expected_scales
    )
    decoded = ref.decode_nvfp4(packed, scale_bytes, global_scale)
    np.testing.assert_allclose(
        decoded, _decode_nvfp4_with_ml_dtypes(packed, scale_bytes, float(g)), rtol=1e-6
    )
    step = np.repeat(expected_scales * float(g), 16, axis=-1)
    # E2M1's widest gap is 4 -> 6 (half-gap 1); a block scale rounded down saturates at most
    # 6 * 2^-4 past 6, still inside that half-gap.
    error = np.abs(decoded - x)
    assert np.all(error <= step * (1.0 + 1e-5))
    small = np.abs(x) <= 2 * step  # below 2 the E2M1 grid step is 0.5
    assert np.all(error[small] <= 0.25 * step[small] * (1 + 1e-5) + 1e-12)


def test_nvfp4_global_scale_is_a_pure_factor():
    x = _keys((16, 128))
    codes_1 = ref.encode_nvfp4(x, 1.0)
    codes_g = ref.encode_nvfp4(x * np.float32(2.0**-7), 2.0**-7)
    np.testing.assert_array_equal(codes_1[0], codes_g[0])
    np.testing.assert_array_equal(codes_1[1], codes_g[1])


def test_nvfp4_4over6_never_worse_and_sometimes_better():
    x = _keys((64, 4, 128))
    plain = ref.decode_nvfp4(*ref.encode_nvfp4(x))
    best = ref.decode_nvfp4(*ref.encode_nvfp4(x, four_over_six=True))
    sq = lambda d: ((d.astype(np.float64) - x) ** 2).reshape(*x.shape[:-1], -1, 16).sum(-1)  # noqa: E731
    assert np.all(sq(best) <= sq(plain) * (1 + 1e-12))
    assert np.mean(sq(best) < sq(plain)) > 0.05


def test_nvfp4_4over6_picks_max_over_4_when_it_is_exact():
    # amax 5: amax/4 = 1.25 is an E4M3 value and every element is 1.25 x an E2M1 value;
    # amax/6 rounds to the E4M3 scale 0.8125 and 5 / 0.8125 = 6.15 saturates to 6.
    block = 5.0 * np.array([1, 0.75, 0.5, 0.375, 0.25, 0.125, 0, -1] * 2, np.float32)
    exact = ref.decode_nvfp4(*ref.encode_nvfp4(block[None], four_over_six=True))[0]
    np.testing.assert_array_equal(exact, block)
    plain_bytes = ref.encode_nvfp4(block[None])
    assert ref.E4M3.decode(plain_bytes[1])[0, 0] == 0.8125
    assert ref.decode_nvfp4(*plain_bytes)[0, 0] == 4.875


# --- SGLang fp4_mx_block16 and mxfp8 ------------------------------------------------------------


def test_fp4_mx_block16_ties_round_up_not_to_even():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    block = np.concatenate([ties, [6.0], -ties, [0.0]]).astype(np.float32)
    decoded = ref.decode_fp4_mx_block16(*ref.encode_fp4_mx_block16(block[None]))[0]
    up = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    np.testing.assert_array_equal(decoded, np.array(up + [6.0] + [-u for u in up] + [0.0]))
    nearest_even = _ml_cast(ties, ml_dtypes.float4_e2m1fn)
    assert np.sum(nearest_even != up) == 4  # 0.25, 1.25, 2.5 and 5 differ from round-to-even


def test_fp4_mx_block16_power_of_two_scale_and_error():
    x = _keys((32, 4, 128)) * np.exp2(_rng().integers(-20, 20, size=(32, 4, 1))).astype(np.float32)
    packed, scale_bytes = ref.encode_fp4_mx_block16(x)
    assert packed.shape[-1] + scale_bytes.shape[-1] == 128 // 2 + 128 // 16
    scale = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    amax = np.abs(x.reshape(*x.shape[:-1], -1, 16)).max(-1)
    ratio = amax / scale  # the smallest power of two that keeps the block within 6
    assert np.all(ratio <= 6.0) and np.all(ratio > 3.0)
    decoded = ref.decode_fp4_mx_block16(packed, scale_bytes)
    elements = _unpack_nibbles(packed).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    manual = (elements.reshape(*x.shape[:-1], -1, 16) * scale[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(decoded, manual)
    assert np.all(np.abs(decoded - x) <= np.repeat(scale, 16, axis=-1) * (1 + 1e-6))


def test_fp4_mx_block16_nibble_order_and_sign_of_zero():
    block = np.zeros(16, np.float32)
    block[:3] = [0.5, -6.0, -0.0]
    packed, scale_bytes = ref.encode_fp4_mx_block16(block[None])
    assert scale_bytes[0, 0] == 127  # amax 6: scale 2^0
    assert packed[0, 0] == 0x1 | (0xF << 4)  # 0.5 -> code 1 (low), -6 -> code 0xF (high)
    assert packed[0, 1] & 0xF == 0  # -0.0 stores +0: the sign is set for x < 0 only


def test_mxfp8_scale_and_codes():
    x = _keys((16, 4, 128)) * np.exp2(_rng().integers(-30, 30, size=(16, 4, 1))).astype(np.float32)
    codes, scale_bytes = ref.encode_mxfp8(x)
    assert codes.shape == x.shape and scale_bytes.shape == (16, 4, 128 // 32)
    scale = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    amax = np.abs(x.reshape(*x.shape[:-1], -1, 32)).max(-1)
    assert np.all(amax / scale <= 448.0) and np.all(amax / scale > 224.0)
    quotient = x.reshape(*x.shape[:-1], -1, 32) / scale[..., None].astype(np.float32)
    expected = _ml_cast(quotient, ml_dtypes.float8_e4m3fn).reshape(x.shape)
    np.testing.assert_array_equal(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), expected)
    decoded = ref.decode_mxfp8(codes, scale_bytes)
    np.testing.assert_allclose(
        decoded, (expected.reshape(quotient.shape) * scale[..., None]).reshape(x.shape)
    )


# --- TurboQuant -------------------------------------------------------------------------------

# J. Max, "Quantizing for minimum distortion" (1960): positive output levels and the mean
# squared error of the optimal quantizer for a unit-variance Gaussian.
MAX_1960_LEVELS = {
    2: [0.4528, 1.510],
    3: [0.2451, 0.7560, 1.344, 2.152],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733],
}
MAX_1960_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}


def _phi(t: float) -> float:
    return math.exp(-t * t / 2) / math.sqrt(2 * math.pi)


def _cdf(t: float) -> float:
    return 0.5 * (1 + math.erf(t / math.sqrt(2)))


def _cell_moments(a: float, b: float) -> tuple[float, float, float]:
    """P(a < Z < b), E[Z; a < Z < b] and E[Z^2; a < Z < b] for Z ~ N(0, 1), in closed form."""
    a_phi = 0.0 if math.isinf(a) else a * _phi(a)
    b_phi = 0.0 if math.isinf(b) else b * _phi(b)
    mass = _cdf(b) - _cdf(a)
    return mass, _phi(a) - _phi(b), mass + a_phi - b_phi


def _unit_cells(head_dim: int, bits: int, **solver) -> tuple[np.ndarray, list[float]]:
    """Centroids scaled to unit variance and their cell edges (outer edges at infinity)."""
    centroids, boundaries = ref.lloyd_max_gaussian(head_dim, bits, **solver)
    sigma = 1 / math.sqrt(head_dim)
    return centroids / sigma, [-math.inf, *(boundaries / sigma), math.inf]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lloyd_max_matches_max_1960(bits, head_dim):
    unit, edges = _unit_cells(head_dim, bits)
    # Max's table has 4 significant digits; the engine's trapezoid integrals (200 steps a cell,
    # the outer cells reaching 10.5 sigma) put its outer levels up to 1.6e-3 inside the optimum.
    np.testing.assert_allclose(unit[len(unit) // 2 :], MAX_1960_LEVELS[bits], atol=2.5e-3)
    np.testing.assert_allclose(unit, -unit[::-1], atol=1e-12)
    distortion = 0.0
    for i, c in enumerate(unit):
        mass, first, second = _cell_moments(edges[i], edges[i + 1])
        distortion += second - 2 * c * first + c * c * mass  # E[(Z - c)^2; cell]
    assert distortion == pytest.approx(MAX_1960_MSE[bits], rel=2e-3)


@pytest.mark.parametrize(
    ("bits", "intervals", "tolerance"),
    [(2, 200, 2e-3), (3, 200, 2e-3), (4, 200, 2e-3), (2, 2000, 2e-5)],
)
def test_lloyd_max_optimality_conditions(bits, intervals, tolerance):
    """Each centroid is its cell's conditional mean (closed form) and each boundary the midpoint
    of its centroids; with finer integration the same algorithm meets this 100x tighter."""
    head_dim = 128
    centroids, boundaries = ref.lloyd_max_gaussian(head_dim, bits, intervals=intervals)
    np.testing.assert_array_equal(boundaries, (centroids[1:] + centroids[:-1]) / 2)
    unit, edges = _unit_cells(head_dim, bits, intervals=intervals)
    for i, c in enumerate(unit):
        mass, first, _ = _cell_moments(edges[i], edges[i + 1])
        assert abs(c - first / mass) < tolerance


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_turboquant_rotation_is_orthonormal_hadamard(head_dim):
    h = ref.orthonormal_hadamard(head_dim)
    np.testing.assert_allclose(h, scipy.linalg.hadamard(head_dim) / math.sqrt(head_dim))
    np.testing.assert_allclose(h @ h, np.eye(head_dim), atol=1e-12)


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_key_codes_are_nearest_centroids_and_norm_is_kept(bits):
    head_dim = 128
    k = _keys((64, 4, head_dim))
    codes, norms = ref.encode_turboquant_key(k, bits)
    assert norms.dtype == np.float16
    np.testing.assert_allclose(norms.astype(np.float64), np.linalg.norm(k, axis=-1), rtol=2.0**-11)
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    rotated = unit @ (scipy.linalg.hadamard(head_dim) / math.sqrt(head_dim))
    centroids = ref.lloyd_max_gaussian(head_dim, bits)[0]
    nearest = np.abs(rotated[..., None] - centroids).argmin(-1)
    assert np.mean(codes == nearest) > 0.9999
    restored = ref.decode_turboquant_key(codes, norms, bits, norm_correction=True)
    np.testing.assert_allclose(
        np.linalg.norm(restored, axis=-1), norms.astype(np.float64), rtol=1e-5
    )
    cosine = (restored * k).sum(-1) / np.linalg.norm(restored, axis=-1) / np.linalg.norm(k, axis=-1)
    # Lloyd-Max MSE of a unit Gaussian coordinate (0.0095 at 4 bits, 0.0345 at 3) bounds the
    # angle: cos ~ sqrt(1 - mse).
    assert cosine.mean() > math.sqrt(1 - MAX_1960_MSE[bits]) - 0.005


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_value_uniform_error_bound(bits):
    v = _keys((64, 4, 128))
    codes, scales, zeros = ref.encode_turboquant_value(v, bits)
    levels = 2**bits - 1
    assert codes.max() <= levels and scales.dtype == np.float16 and zeros.dtype == np.float16
    np.testing.assert_allclose(
        scales.astype(np.float64), np.ptp(v, axis=-1) / levels, rtol=2.0**-11
    )
    np.testing.assert_array_equal(zeros, v.min(-1).astype(np.float16))
    restored = ref.decode_turboquant_value(codes, scales, zeros)
    s = np.ptp(v, axis=-1, keepdims=True) / levels
    fp16_slack = 2.0**-11 * (np.abs(v.min(-1, keepdims=True)) + levels * s)
    assert np.all(np.abs(restored - v) <= 0.5 * s + fp16_slack + 1e-6)


@pytest.mark.parametrize("name", sorted(ref.TURBOQUANT_PRESETS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_turboquant_slot_round_trip(name, head_dim):
    k, v = _keys((8, 2, head_dim)), _rng().standard_normal((8, 2, head_dim)).astype(np.float32)
    slots = ref.encode_turboquant(k, v, name)
    assert slots.dtype == np.uint8 and slots.shape == (
        8,
        2,
        ref.turboquant_slot_bytes(name, head_dim),
    )
    keys, values = ref.decode_turboquant(slots, name, head_dim)
    preset = ref.TURBOQUANT_PRESETS[name]
    if preset.key_bits == 8:  # unscaled E4M3 keys
        np.testing.assert_array_equal(
            keys, _ml_cast(np.clip(k, -448, 448), ml_dtypes.float8_e4m3fn)
        )
    else:
        key_bytes = math.ceil(head_dim * preset.key_bits / 8)
        stored_norm = slots[..., key_bytes : key_bytes + 2].copy().view("<f2")[..., 0]
        np.testing.assert_allclose(np.linalg.norm(keys, axis=-1), stored_norm, rtol=1e-5)
    codes, scales, zeros = ref.encode_turboquant_value(v, preset.value_bits)
    np.testing.assert_array_equal(values, ref.decode_turboquant_value(codes, scales, zeros))


def test_turboquant_boundary_layers_and_skip_list():
    assert ref.turboquant_skip_layers(32) == [0, 1, 30, 31]
    assert ref.turboquant_skip_layers(3) == [0, 2]
    assert ref.turboquant_skip_layers(1) == []
    assert ref.turboquant_skip_layers(32, is_hybrid=True) == []
    dtype = "turboquant_k3v4_nc"
    layer_dtypes = [ref.vllm_layer_kv_dtype(i, dtype, 30, skip_layers=("7",)) for i in range(30)]
    assert [i for i, d in enumerate(layer_dtypes) if d == "auto"] == [0, 1, 7, 28, 29]
    assert ref.vllm_layer_kv_dtype(0, "fp8", 30) == "fp8"
    assert (
        ref.vllm_layer_kv_dtype(5, "fp8", 30, ("sliding_window",), is_sliding_window=True) == "auto"
    )


# --- bytes per token and KV head ---------------------------------------------------------------

# K + V bytes one token costs in one layer for one KV head, from docs/engine_formats.md.
EXPECTED_BYTES = {
    ("vllm", "auto"): (256, 512),
    ("vllm", "fp8"): (128, 256),
    ("vllm", "fp8_e5m2"): (128, 256),
    ("vllm", "fp8_per_token_head"): (136, 264),
    ("vllm", "int8_per_token_head"): (136, 264),
    ("vllm", "int4_per_token_head"): (72, 136),
    ("vllm", "nvfp4"): (72, 144),
    ("vllm", "nvfp4_4over6"): (72, 144),
    ("vllm", "turboquant_k8v4"): (100, 196),
    ("vllm", "turboquant_4bit_nc"): (70, 134),
    ("vllm", "turboquant_k3v4_nc"): (62, 118),
    ("vllm", "turboquant_3bit_nc"): (54, 102),
    ("sglang", "bf16"): (256, 512),
    ("sglang", "fp8_e4m3"): (128, 256),
    ("sglang", "mxfp8"): (132, 264),
    ("sglang", "nvfp4"): (72, 144),
    ("sglang", "fp4_mx_block16"): (72, 144),
}


@pytest.mark.parametrize(("engine", "dtype"), sorted(EXPECTED_BYTES))
def test_bytes_per_token_head_formulas(engine, dtype):
    got = tuple(ref.kv_bytes_per_token_head(engine, dtype, d) for d in HEAD_DIMS)
    assert got == EXPECTED_BYTES[engine, dtype]


def _stored_bytes(arrays) -> int:
    """Bytes per vector of what an encoder returned for one (1, head_dim) input."""
    return sum(np.asarray(a).nbytes for a in arrays)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_bytes_formulas_match_encoder_outputs(head_dim):
    x = _keys((1, head_dim))
    d = head_dim
    side = {
        ("vllm", "fp8"): _stored_bytes([ref.encode_fp8_per_tensor(x)]),
        ("vllm", "int8_per_token_head"): _stored_bytes(ref.encode_per_token_head(x, "int8")),
        ("vllm", "fp8_per_token_head"): _stored_bytes(ref.encode_per_token_head(x, "fp8")),
        ("vllm", "int4_per_token_head"): _stored_bytes(ref.encode_int4_per_token_head(x)),
        ("vllm", "nvfp4"): _stored_bytes(ref.encode_nvfp4(x)),
        ("sglang", "fp4_mx_block16"): _stored_bytes(ref.encode_fp4_mx_block16(x)),
        ("sglang", "mxfp8"): _stored_bytes(ref.encode_mxfp8(x)),
    }
    for (engine, dtype), one_side in side.items():
        assert 2 * one_side == ref.kv_bytes_per_token_head(engine, dtype, d), (engine, dtype)
    for name in ref.TURBOQUANT_PRESETS:
        slot = ref.encode_turboquant(x, x, name)
        assert slot.nbytes == ref.kv_bytes_per_token_head("vllm", name, d)


def test_bytes_reject_unknown_dtype():
    with pytest.raises(ValueError, match="kv-cache-dtype='int3'"):
        ref.kv_bytes_per_token_head("vllm", "int3", 128)
