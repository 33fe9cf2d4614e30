"""copy_blocks moves codes and scales between pools byte for byte (the host tier's fetches
and demotions): checked against a loop over blocks, token rows and heads written in the test,
and it refuses pools whose tensor scales differ in value, wherever the scales are stored."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.cache.pool import KVPool, copy_blocks
from kvtune.kernels.formats.kv_format import KVFormat

# Each test runs with the CPU kernels and with the torch paths alone.
pytestmark = pytest.mark.usefixtures("cpu_paths")

BLOCK, HEADS, HEAD_DIM = 4, 3, 64
# Per-token int4 scales and zero points, and per-channel ones shared by a block's tokens.
FORMATS = [
    KVFormat("int4", 32, "fp16"),
    KVFormat("int4", 1, "fp16", token_group=BLOCK),
]


def _filled(fmt: KVFormat, blocks: int, scale: torch.Tensor, seed: int) -> KVPool:
    """A pool whose code and scale bytes are random (copying never decodes them)."""
    pool = KVPool.allocate(fmt, blocks, BLOCK, HEADS, HEAD_DIM, scale)
    generator = torch.Generator().manual_seed(seed)
    pool.codes.copy_(torch.randint(0, 256, pool.codes.shape, generator=generator))
    # Positive finite fp16 bit patterns (below 0x7C00), so that equality is bitwise.
    raw = torch.randint(0, 0x7C00, pool.scales.shape, generator=generator, dtype=torch.int16)
    pool.scales.copy_(raw.view(pool.scales.dtype))
    return pool


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-tg{f.token_group}")
def test_head_slices_are_copied_byte_for_byte_and_nothing_else(fmt):
    scale = torch.tensor([0.5])
    src, dst = _filled(fmt, 6, scale, 1), _filled(fmt, 5, scale, 2)
    before = [dst.codes.clone(), dst.scales.clone()]
    reads, writes, heads = [4, 0, 4, 2], [1, 3, 0, 1], [2, 0, 1, 0]
    copy_blocks(src, torch.tensor(reads), dst, torch.tensor(writes), torch.tensor(heads))
    for tensor, (src_tensor, old) in zip(
        (dst.codes, dst.scales), ((src.codes, before[0]), (src.scales, before[1])), strict=True
    ):
        expected = old.clone()
        for read, write, head in zip(reads, writes, heads, strict=True):
            for row in range(tensor.shape[1]):  # token rows (1 for a block-shared scale row)
                expected[write, row, head] = src_tensor[read, row, head]
        assert torch.equal(tensor, expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-tg{f.token_group}")
def test_whole_blocks_are_copied_byte_for_byte(fmt):
    scale = torch.tensor([2.0])
    src, dst = _filled(fmt, 6, scale, 3), _filled(fmt, 5, scale, 4)
    expected = [dst.codes.clone(), dst.scales.clone()]
    for read, write in ((5, 2), (1, 4)):
        expected[0][write] = src.codes[read]
        expected[1][write] = src.scales[read]
    copy_blocks(src, torch.tensor([5, 1]), dst, torch.tensor([2, 4]))
    assert torch.equal(dst.codes, expected[0]) and torch.equal(dst.scales, expected[1])


def test_tensor_scales_are_compared_by_value_not_by_storage():
    fmt = FORMATS[0]
    src = _filled(fmt, 2, torch.tensor([0.25]), 5)
    # Equal values in another tensor: copied.
    copy_blocks(src, torch.tensor([0]), _filled(fmt, 2, torch.tensor([0.25]), 6), torch.tensor([1]))
    # One storage with another value (a view of a different element): refused.
    scales = torch.tensor([0.25, 0.5])
    other = _filled(fmt, 2, scales[1:], 7)
    with pytest.raises(ValueError, match="tensor scale"):
        copy_blocks(_filled(fmt, 2, scales[:1], 8), torch.tensor([0]), other, torch.tensor([1]))
