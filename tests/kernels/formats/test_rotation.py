"""Randomized Hadamard rotation: the matrix against its closed form (and scipy), orthonormality,
the documented seed rule, attention invariance against SDPA, and the outlier-channel error it
removes before per-token quantization."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref
from kvtune.kernels.formats.rotation import (
    KVRotation,
    check_rotation,
    hadamard_matrix,
    kv_rotation,
    randomized_hadamard,
    rotate,
    rotate_queries,
    unrotate,
)
from tests.kernels.formats import engine_formats_ref as ref


def _sylvester(size: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix by its closed form: entry (i, j) = (-1)^popcount(i AND j)."""
    parity = [[bin(i & j).count("1") % 2 for j in range(size)] for i in range(size)]
    return 1 - 2 * torch.tensor(parity, dtype=torch.float32)


@pytest.mark.parametrize("size", [1, 2, 4, 16, 64, 128, 256])
def test_hadamard_matrix_matches_the_closed_form(size: int) -> None:
    assert torch.equal(hadamard_matrix(size), _sylvester(size))


def test_hadamard_matrix_matches_scipy() -> None:
    linalg = pytest.importorskip("scipy.linalg")
    for size in (8, 128):
        assert torch.equal(hadamard_matrix(size), torch.from_numpy(linalg.hadamard(size)).float())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotation_is_orthonormal_and_follows_the_seed_rule(head_dim: int) -> None:
    """R = diag(s_l) H / sqrt(D), s_l = 2 * randint(0, 2) - 1 from a CPU generator seeded l."""
    rotations = [kv_rotation("hadamard", head_dim, layer) for layer in range(4)]
    assert all(r.keys is r.values for r in rotations)  # K and V share R
    matrices = [r.keys.matrix for r in rotations]
    sylvester = _sylvester(head_dim)
    for layer, matrix in enumerate(matrices):
        generator = torch.Generator().manual_seed(layer)
        signs = torch.randint(0, 2, (head_dim,), generator=generator) * 2.0 - 1.0
        assert torch.equal(matrix, torch.diag(signs) @ sylvester / math.sqrt(head_dim))
        identity = matrix.double() @ matrix.double().T
        assert torch.allclose(identity, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    assert not torch.equal(matrices[0], matrices[1])
    assert torch.equal(matrices[2], randomized_hadamard(head_dim, 2))
    assert kv_rotation("none", head_dim, 0) == KVRotation()
    assert kv_rotation("hadamard", head_dim, 0, quantized=(False, False)) == KVRotation()


@pytest.mark.parametrize(("head_dim", "num_kv_heads", "group"), [(64, 2, 3), (128, 1, 4)])
def test_attention_is_unchanged_by_rotating_q_k_v_and_unrotating_the_output(
    head_dim: int, num_kv_heads: int, group: int
) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = 37
    q = torch.randn(1, num_kv_heads * group, tokens, head_dim, generator=generator)
    k = torch.randn(1, num_kv_heads, tokens, head_dim, generator=generator) * 3
    v = torch.randn(1, num_kv_heads, tokens, head_dim, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for name in ("hadamard", "vllm_rht", "llamacpp"):
        rotation = kv_rotation(name, head_dim, layer=5)
        rotated = F.scaled_dot_product_attention(
            rotate_queries(q, rotation.keys),
            rotate(k, rotation.keys),
            rotate(v, rotation.values),
            is_causal=True,
            enable_gqa=True,
            scale=head_dim**-0.5,
        )
        restored = unrotate(rotated, rotation.values)
        assert torch.allclose(restored, expected, atol=1e-5, rtol=1e-5), name


def test_rotation_shrinks_the_logit_error_of_keys_with_outlier_channels() -> None:
    """Keys with two large channels (as RoPE pairs make them) in int4 with one scale and zero
    point per token and head (vLLM's int4_per_token_head): the outliers set the scale and the
    other channels keep few codes, unless the keys are rotated first."""
    generator = torch.Generator().manual_seed(1)
    head_dim = 64
    fmt = KVFormat("int4", head_dim)
    keys = torch.randn(256, head_dim, generator=generator)
    keys[:, [5, 37]] *= 30
    queries = torch.randn(16, head_dim, generator=generator)
    rotation = kv_rotation("hadamard", head_dim, layer=0).keys

    def stored(x: torch.Tensor) -> torch.Tensor:
        return dequantize_ref(*quantize_ref(x, fmt), fmt, None, head_dim)

    exact = queries @ keys.T
    plain_error = (queries @ stored(keys).T - exact).abs().mean()
    rotated_keys = stored(rotate(keys, rotation))
    rotated_error = (rotate_queries(queries, rotation) @ rotated_keys.T - exact).abs().mean()
    assert rotated_error < plain_error / 2


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_vllm_rht_is_vllms_transform_with_its_block_gain(head_dim: int) -> None:
    # The oracle: the numpy reference written from vLLM's int4_per_token_head source.
    rotation = kv_rotation("vllm_rht", head_dim, layer=7).values
    assert rotation.gain == {64: 64, 96: 32, 128: 128}[head_dim] and rotation.round_to_input
    x = torch.randn(5, head_dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = ref.rht(x.numpy())
    # fp64 sums in another order: equal up to the last bits.
    np.testing.assert_allclose(
        (x @ rotation.matrix.double()).numpy(), expected, rtol=1e-13, atol=1e-12
    )
    np.testing.assert_allclose(
        ref.rht(expected, inverse=True) / rotation.gain, x, rtol=1e-13, atol=1e-12
    )
    assert torch.equal(rotation.matrix, kv_rotation("vllm_rht", head_dim, layer=0).keys.matrix)
    bf16 = x.to(torch.bfloat16)
    assert torch.equal(rotate(bf16, rotation), rotate(bf16.float(), rotation).bfloat16().float())


def test_refuses_unknown_rotations_and_sizes_hadamard_cannot_rotate() -> None:
    with pytest.raises(ValueError, match="rotation='givens'"):
        check_rotation("givens", 64)
    with pytest.raises(ValueError, match="head_dim=96"):
        kv_rotation("hadamard", 96, 0)
    with pytest.raises(ValueError, match="size=12"):
        hadamard_matrix(12)
    check_rotation("none", 96)
