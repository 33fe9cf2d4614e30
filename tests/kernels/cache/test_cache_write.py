"""Fused K/V cache write: Triton vs torch reference bit for bit, and vs quantizing directly."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.cache.pool import KVPool, read_vectors_ref
from kvtune.kernels.cache.write import write_kv, write_kv_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import quantize_ref

FORMAT_PAIRS = [
    (KVFormat("fp8", 32), KVFormat("fp8", 32)),
    (KVFormat("fp8"), KVFormat("fp4", 16, "e4m3")),
    (KVFormat("fp4", 16, "e4m3"), KVFormat("fp4", 64)),
    (KVFormat("fp8", 16, "e4m3"), KVFormat("fp16")),
    (KVFormat("bf16"), KVFormat("fp4")),
    (KVFormat("fp32"), KVFormat("fp8", 64)),
    (KVFormat("int4", 32), KVFormat("int2", 16)),
    (KVFormat("int8", 64), KVFormat("fp4", 16, "e4m3")),
    (KVFormat("fp16"), KVFormat("int4", 64)),
    (KVFormat("lloyd3", 64), KVFormat("int3_tq", 64)),
    (KVFormat("lloyd4", 64), KVFormat("int3", 16)),
]


def _pools(
    k_fmt: KVFormat, v_fmt: KVFormat, num_blocks: int, block_size: int, heads: int, head_dim: int
) -> tuple[KVPool, KVPool]:
    """Pools filled with a recognisable byte so untouched slots can be checked."""
    pools = []
    for fmt, scale in ((k_fmt, 0.03), (v_fmt, 0.5)):
        pool = KVPool.allocate(fmt, num_blocks, block_size, heads, head_dim, torch.tensor([scale]))
        pool.codes.view(torch.uint8).fill_(0x5A)
        if pool.scales is not None:
            pool.scales.view(torch.uint8).fill_(0x3C)
        pools.append(pool)
    return pools[0], pools[1]


def _clone(pool: KVPool) -> KVPool:
    scales = pool.scales.clone() if pool.scales is not None else None
    return KVPool(pool.codes.clone(), scales, pool.fmt, pool.tensor_scale)


def _assert_same_bits(pool: KVPool, expected: KVPool) -> None:
    assert torch.equal(pool.codes.view(torch.uint8), expected.codes.view(torch.uint8))
    if pool.scales is not None:
        assert torch.equal(pool.scales.view(torch.uint8), expected.scales.view(torch.uint8))


def _slot_mapping(num_tokens: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct random slots, every fifth token skipped (-1)."""
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::5] = -1
    return slots


@pytest.mark.parametrize(("k_fmt", "v_fmt"), FORMAT_PAIRS, ids=str)
@pytest.mark.parametrize(
    ("heads", "block_size", "num_tokens"), [(1, 8, 13), (3, 16, 37), (8, 32, 21)]
)
def test_write_matches_reference(
    k_fmt: KVFormat, v_fmt: KVFormat, heads: int, block_size: int, num_tokens: int
) -> None:
    generator = torch.Generator().manual_seed(heads * block_size)
    head_dim = 64
    k_pool, v_pool = _pools(k_fmt, v_fmt, 4, block_size, heads, head_dim)
    k_expected, v_expected = _clone(k_pool), _clone(v_pool)
    k_new = torch.randn(num_tokens, heads, head_dim, generator=generator).bfloat16()
    v_new = torch.randn(num_tokens, heads, head_dim, generator=generator) * 4
    slots = _slot_mapping(num_tokens, 4 * block_size, generator)
    write_kv(k_new, v_new, slots, k_pool, v_pool)
    write_kv_ref(k_new, v_new, slots, k_expected, v_expected)
    _assert_same_bits(k_pool, k_expected)
    _assert_same_bits(v_pool, v_expected)
    written = slots[slots >= 0]
    untouched = torch.ones(k_pool.num_slots, dtype=torch.bool)
    untouched[written] = False
    assert (k_pool.codes.view(torch.uint8).flatten(0, 1)[untouched] == 0x5A).all()


def test_written_slots_hold_the_quantized_vectors() -> None:
    """Independent of write_kv_ref: each written slot equals quantize_ref of its token."""
    fmt = KVFormat("fp4", 16, "e4m3")
    k_pool, v_pool = _pools(fmt, KVFormat("fp8", 32), 3, 16, 2, 128)
    k_new = torch.randn(10, 2, 128)
    v_new = torch.randn(10, 2, 128)
    slots = torch.tensor([47, 0, -1, 16, 15, 1, -3, 30, 31, 2], dtype=torch.int32)
    write_kv(k_new, v_new, slots, k_pool, v_pool)
    keep = slots >= 0
    codes, scales = quantize_ref(k_new[keep], fmt, k_pool.tensor_scale)
    assert torch.equal(k_pool.codes.flatten(0, 1)[slots[keep].long()], codes)
    assert torch.equal(k_pool.scales.flatten(0, 1)[slots[keep].long()], scales)
    v_values = read_vectors_ref(v_pool, slots[keep])
    assert torch.allclose(v_values, v_new[keep], rtol=2.0**-4, atol=v_new.abs().max() / 448)


def test_strided_inputs_are_read_in_place() -> None:
    """k_new / v_new as views into a fused qkv projection output (non-contiguous)."""
    qkv = torch.randn(9, 3, 4, 64)
    k_new, v_new = qkv[:, 1], qkv[:, 2]
    fmt = KVFormat("fp8", 64)
    k_pool, v_pool = _pools(fmt, fmt, 2, 8, 4, 64)
    k_expected, v_expected = _clone(k_pool), _clone(v_pool)
    slots = torch.arange(9) + 3
    write_kv(k_new, v_new, slots, k_pool, v_pool)
    write_kv_ref(k_new.contiguous(), v_new.contiguous(), slots, k_expected, v_expected)
    _assert_same_bits(k_pool, k_expected)
    _assert_same_bits(v_pool, v_expected)


def test_rejects_mismatched_shapes() -> None:
    fmt = KVFormat("fp8", 32)
    k_pool, v_pool = _pools(fmt, fmt, 2, 8, 2, 64)
    with pytest.raises(ValueError, match="k_new.shape"):
        write_kv(torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.arange(3), k_pool, v_pool)
    with pytest.raises(ValueError, match="slot_mapping"):
        x = torch.randn(3, 2, 64)
        write_kv(x, x, torch.arange(3.0), k_pool, v_pool)
