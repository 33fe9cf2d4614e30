"""Summaries pooled as if before RoPE: the oracle is the model's own RoPE (runtime.model
apply_rope) applied to the mean of the raw keys at the group's centre position."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.cache.compress import compress_blocks, compress_blocks_ref
from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.cache.rope_align import summary_alignment
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import kv_rotation
from kvtune.runtime.model import apply_rope

HEADS, BLOCK = 2, 16


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return apply_rope(x.double(), angles.cos(), angles.sin()).float()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [2, 4, 8])
@pytest.mark.parametrize("rotation_name", ["none", "hadamard", "vllm_rht"])
@pytest.mark.parametrize("compress", [compress_blocks, compress_blocks_ref])
def test_pooled_keys_equal_rope_of_the_mean_of_raw_keys(head_dim, ratio, rotation_name, compress):
    generator = torch.Generator().manual_seed(head_dim + ratio)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    raw = torch.randn(BLOCK, HEADS, head_dim, generator=generator)
    positions = torch.arange(BLOCK) + 3 * BLOCK
    cached = _rope(raw, positions, inv_freq)
    rotation = kv_rotation(rotation_name, head_dim, 5).keys
    if rotation is not None:
        cached = cached @ rotation.matrix
    source = KVPool.allocate(KVFormat("fp32"), 4, BLOCK, HEADS, head_dim)
    write_vectors_ref(source, torch.arange(BLOCK) + 2 * BLOCK, cached)
    target = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, HEADS, head_dim)
    slots = torch.arange(BLOCK // ratio)
    align = summary_alignment(inv_freq, ratio, rotation)
    compress(source, torch.tensor([2]), target, slots, ratio, align)
    pooled = read_vectors_ref(target, slots)
    if rotation is not None:
        pooled = pooled @ rotation.matrix.T / rotation.gain
    centres = positions.double().unflatten(0, (-1, ratio)).mean(1)
    expected = _rope(raw.unflatten(0, (-1, ratio)).mean(1), centres, inv_freq)
    torch.testing.assert_close(pooled, expected, atol=2e-5, rtol=0)


def test_post_rope_mean_loses_fast_pairs_and_the_aligned_mean_keeps_them():
    """The motivation, measured: a constant raw key, pooled over 8 positions. Its fastest pair
    turns 1 rad a token, so the post-RoPE mean keeps |sin(4)/ (8 sin(1/2))| = 0.197 of it."""
    head_dim, ratio = 64, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    key = torch.zeros(ratio, 1, head_dim)
    key[:, :, 0] = 1.0  # pair 0: channels 0 and 32, 1 rad a position
    cached = _rope(key, torch.arange(ratio), inv_freq)
    post = cached.mean(0)
    aligned = torch.einsum("thd,tde->he", cached, summary_alignment(inv_freq, ratio, None)) / ratio
    assert float(post[0, [0, 32]].norm()) == pytest.approx(0.197, abs=1e-3)
    assert float(aligned[0, [0, 32]].norm()) == pytest.approx(1.0, abs=1e-5)


def test_quantized_destination_matches_reference_within_a_code():
    """fp8 destination: Triton (tl.dot) and torch (einsum) sum in different orders, so a
    value may land one code apart; nearly all must agree exactly."""
    head_dim, ratio = 64, 4
    generator = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    source = KVPool.allocate(KVFormat("fp16"), 3, BLOCK, HEADS, head_dim)
    write_vectors_ref(
        source,
        torch.arange(3 * BLOCK),
        torch.randn(3 * BLOCK, HEADS, head_dim, generator=generator),
    )
    align = summary_alignment(inv_freq, ratio, kv_rotation("hadamard", head_dim, 1).keys)
    pools = [KVPool.allocate(KVFormat("fp8", 32), 2, BLOCK, HEADS, head_dim) for _ in range(2)]
    slots = torch.arange(2 * BLOCK // ratio) + 3
    for compress, pool in zip((compress_blocks, compress_blocks_ref), pools, strict=True):
        compress(source, torch.tensor([2, 0]), pool, slots, ratio, align)
    a, b = (read_vectors_ref(pool, slots) for pool in pools)
    assert (a == b).float().mean() > 0.99
    torch.testing.assert_close(a, b, atol=0.07 * float(b.abs().max()), rtol=0)


def test_alignment_of_the_wrong_shape_is_refused():
    source = KVPool.allocate(KVFormat("fp16"), 1, BLOCK, HEADS, 64)
    target = KVPool.allocate(KVFormat("fp16"), 1, BLOCK, HEADS, 64)
    with pytest.raises(ValueError, match="align"):
        compress_blocks_ref(source, torch.tensor([0]), target, torch.arange(4), 4, torch.eye(64))
