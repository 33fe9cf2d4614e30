"""llama.cpp's cache rotation (policy rotation: llamacpp) against its definition: the
Walsh-Hadamard matrix built here from Sylvester's closed form and from the numpy port of
`ggml_gen_hadamard`, the block sizes of build_input_k_rot / build_input_v_rot, only the quantized
streams, and the products bit for bit as ggml's CPU computes them (the port of
`ggml_compute_forward_fwht`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvtune.kernels.formats.rotation import Rotation, kv_rotation, rotate, rotate_queries, unrotate
from tests.kernels.formats import llamacpp_formats_ref as ref

HEAD_DIMS = [64, 96, 128, 192, 256]
STREAMS = list(itertools.product([True, False], repeat=2))


def sylvester_blocks(head_dim: int, block: int) -> torch.Tensor:
    """Block-diagonal [head_dim, head_dim]: blocks of entry (i, j) = (-1)^popcount(i AND j)
    times the float 1.0 / sqrtf(block) (a double division stored as a float, as
    ggml_gen_hadamard writes it)."""
    entry = np.float32(1.0 / float(np.sqrt(np.float32(block))))
    signs = [[1 - 2 * (bin(i & j).count("1") % 2) for j in range(block)] for i in range(block)]
    one = torch.tensor(signs, dtype=torch.float32) * float(entry)
    return torch.block_diag(*[one] * (head_dim // block))


def stream(rotation, keys: bool) -> Rotation | None:
    return rotation.keys if keys else rotation.values


@pytest.mark.parametrize("quantized", STREAMS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_rotation_is_ggmls_hadamard_on_the_quantized_streams(head_dim, quantized):
    """Keys: blocks of the largest power-of-two divisor of head_dim; values: blocks of 64; a
    stream only where its type is quantized and head_dim is a multiple of 64; the same matrix
    in every layer; orthonormal (gain 1)."""
    blocks = ref.rotation_blocks(head_dim, *quantized)
    rotation = kv_rotation("llamacpp", head_dim, layer=3, quantized=quantized)
    other_layer = kv_rotation("llamacpp", head_dim, layer=11, quantized=quantized)
    for keys, block in zip((True, False), blocks, strict=True):
        mine = stream(rotation, keys)
        if block == 0:
            assert mine is None
            continue
        expected = sylvester_blocks(head_dim, block)
        port = torch.block_diag(*[torch.from_numpy(ref.gen_hadamard(block))] * (head_dim // block))
        assert torch.equal(expected, port)
        assert torch.equal(mine.matrix, expected)
        assert (mine.butterflies, mine.gain, mine.round_to_input) == (block, 1.0, False)
        assert torch.equal(stream(other_layer, keys).matrix, expected)
        identity = mine.matrix.double() @ mine.matrix.double().T
        torch.testing.assert_close(identity, torch.eye(head_dim, dtype=torch.float64))


@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_products_have_ggmls_cpu_bits(head_dim):
    """rotate, rotate_queries and unrotate (H is symmetric: its own inverse) give, bit for bit,
    llama_mul_mat_hadamard as the CPU computes it: rows of `block` consecutive elements, each
    scaled by 1.0f / sqrtf(block), then butterflies in fp32; that is x @ H to fp32 rounding."""
    generator = torch.Generator().manual_seed(head_dim)
    x = torch.randn(5, 2, head_dim, generator=generator) * 3
    x[0, 0, :7] = torch.tensor([1e4, -1e-4, 0.0, -0.0, 65504.0, 1e-30, 3.0])
    rotation = kv_rotation("llamacpp", head_dim, layer=0)
    for mine in (rotation.keys, rotation.values):
        expected = ref.mul_mat_hadamard(x.numpy(), mine.butterflies)
        for product in (rotate, rotate_queries, unrotate):
            np.testing.assert_array_equal(product(x, mine).numpy(), expected)
        fp32_rounding = 1e-6 * float(x.abs().max())
        exact = x.double() @ mine.matrix.double()
        torch.testing.assert_close(rotate(x, mine).double(), exact, rtol=0, atol=fp32_rounding)
        torch.testing.assert_close(unrotate(rotate(x, mine), mine), x, rtol=0, atol=fp32_rounding)


def test_bf16_vectors_rotate_as_their_fp32_values():
    """llama.cpp's activations reach the rotation in fp32; a bf16 model's K and V are rotated
    from their fp32 values (no rounding back to bf16, unlike vllm_rht)."""
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    keys = kv_rotation("llamacpp", 128, layer=0).keys
    assert torch.equal(rotate(x, keys), rotate(x.float(), keys))
    assert rotate(x, keys).dtype == torch.float32
