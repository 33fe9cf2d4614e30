"""CSA block pooling: Triton vs torch reference bit for bit, and vs a plain torch mean."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.cache.compress import compress_blocks, compress_blocks_ref
from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat

FORMAT_PAIRS = [
    (KVFormat("fp16"), KVFormat("fp8", 32)),
    (KVFormat("fp8", 16), KVFormat("fp8", 16)),
    (KVFormat("fp8"), KVFormat("fp4", 16, "e4m3")),
    (KVFormat("fp4", 32), KVFormat("bf16")),
    (KVFormat("fp4", 16, "e4m3"), KVFormat("fp4", 64)),
    (KVFormat("bf16"), KVFormat("fp32")),
    (KVFormat("int4", 32), KVFormat("int4", 32)),
    (KVFormat("fp16"), KVFormat("int2", 16)),
    (KVFormat("int8", 16), KVFormat("fp8", 32)),
    (KVFormat("fp4_4over6", 16, "e4m3"), KVFormat("fp4_4over6", 32)),
    (KVFormat("int4_zp_in_scale", 64, "fp32"), KVFormat("int4_zp_in_scale", 32, "fp32")),
]
HEAD_DIM = 64


def _filled_pool(fmt: KVFormat, num_blocks: int, block_size: int, heads: int, seed: int) -> KVPool:
    """A pool whose every slot holds a quantized random vector (tensor scale 0.02 when used)."""
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool.allocate(fmt, num_blocks, block_size, heads, HEAD_DIM, torch.tensor([0.02]))
    vectors = torch.randn(pool.num_slots, heads, HEAD_DIM, generator=generator) * 3
    write_vectors_ref(pool, torch.arange(pool.num_slots), vectors)
    return pool


def _empty_like(pool: KVPool) -> KVPool:
    scales = pool.scales.clone() if pool.scales is not None else None
    return KVPool(pool.codes.clone(), scales, pool.fmt, pool.tensor_scale)


def _summary_slots(count: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct random destination slots, every seventh summary skipped (-1)."""
    slots = torch.randperm(num_slots, generator=generator)[:count]
    slots[3::7] = -1
    return slots


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), FORMAT_PAIRS, ids=str)
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
@pytest.mark.parametrize(("heads", "block_size"), [(1, 8), (3, 16)])
def test_compress_matches_reference(
    src_fmt: KVFormat, dst_fmt: KVFormat, ratio: int, heads: int, block_size: int
) -> None:
    generator = torch.Generator().manual_seed(ratio * block_size)
    src = _filled_pool(src_fmt, 5, block_size, heads, seed=ratio)
    dst = KVPool.allocate(dst_fmt, 6, block_size, heads, HEAD_DIM, torch.tensor([0.01]))
    dst_expected = _empty_like(dst)
    block_ids = torch.tensor([3, 0, 4], dtype=torch.int32)
    slots = _summary_slots(3 * block_size // ratio, dst.num_slots, generator)
    compress_blocks(src, block_ids, dst, slots, ratio)
    compress_blocks_ref(src, block_ids, dst_expected, slots, ratio)
    assert torch.equal(dst.codes.view(torch.uint8), dst_expected.codes.view(torch.uint8))
    if dst.scales is not None:
        assert torch.equal(dst.scales.view(torch.uint8), dst_expected.scales.view(torch.uint8))
    assert dst.codes.view(torch.uint8).any()


# Worst-case error of storing a vector, in units of its amax (see test_quantize.ERROR_BOUND).
# The integer formats: half a grid step of a range <= 2 amax, i.e. amax / max_code, plus the
# fp16 rounding of the scale and zero point (< 2^-10 amax).
STORE_ERROR = {
    "fp32": 1e-6,
    "bf16": 2.0**-8,
    "fp8": 2.0**-4 * 17 / 16,
    "fp4": (1 / 6) * 17 / 16,
    "fp4_4over6": (1 / 6) * 17 / 16,  # the amax / 4 candidate errs at most amax / 8 * 17 / 16
    **{f"int{bits}": 1 / (2**bits - 1) + 2.0**-10 for bits in (8, 4, 2)},
    "int4_zp_in_scale": 1 / 15 + 2.0**-10,
}


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), FORMAT_PAIRS, ids=str)
@pytest.mark.parametrize("ratio", [1, 4])
def test_summaries_are_the_mean_of_dequantized_tokens(
    src_fmt: KVFormat, dst_fmt: KVFormat, ratio: int
) -> None:
    """Independent of compress_blocks_ref: a torch mean, up to the destination's rounding."""
    block_size, heads = 16, 2
    src = _filled_pool(src_fmt, 4, block_size, heads, seed=7)
    dst = KVPool.allocate(dst_fmt, 4, block_size, heads, HEAD_DIM, torch.tensor([0.01]))
    block_ids = torch.tensor([2, 1])
    slots = torch.arange(2 * block_size // ratio) + 5
    compress_blocks(src, block_ids, dst, slots, ratio)
    tokens = read_vectors_ref(src, (block_ids[:, None] * block_size + torch.arange(16)).flatten())
    mean = tokens.unflatten(0, (-1, ratio)).mean(dim=1)
    summaries = read_vectors_ref(dst, slots)
    bound = STORE_ERROR[dst_fmt.dtype] * mean.abs().amax(dim=-1, keepdim=True)
    assert ((summaries - mean).abs() <= bound + 1e-7).all()


def test_ratio_one_copy_of_unquantized_block_is_exact() -> None:
    src = _filled_pool(KVFormat("fp16"), 3, 8, 2, seed=9)
    src.codes[2, :, :, ::5] = -0.0
    dst = KVPool.allocate(KVFormat("fp16"), 2, 8, 2, HEAD_DIM)
    compress_blocks(src, torch.tensor([2]), dst, torch.arange(8) + 8, 1)
    assert torch.equal(dst.codes[1].view(torch.int16), src.codes[2].view(torch.int16))
    assert not dst.codes[0].any()


def test_rejects_bad_arguments() -> None:
    src = _filled_pool(KVFormat("fp8", 32), 2, 8, 1, seed=0)
    dst = KVPool.allocate(KVFormat("fp8", 32), 2, 8, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="ratio=3"):
        compress_blocks(src, torch.tensor([0]), dst, torch.arange(2), 3)
    with pytest.raises(ValueError, match="dst_slots has 3"):
        compress_blocks(src, torch.tensor([0]), dst, torch.arange(3), 2)
    other = KVPool.allocate(KVFormat("fp8", 32), 2, 8, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="heads"):
        compress_blocks(src, torch.tensor([0]), other, torch.arange(4), 2)
