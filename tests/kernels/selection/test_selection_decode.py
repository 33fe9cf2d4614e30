"""The Triton decode scoring kernel against products written from their definitions.

Index vectors are written to shuffled pool blocks in the index formats the runtime uses (and
a per-channel format whose scales a block shares), slots past each length hold NaN, and the
oracle computes each product in a loop over dequantized vectors read slot by slot: Quest's
sum_d max(q_d hi_d, q_d lo_d) for bounds, q . k for means and summaries. Picks are checked end
to end against select_blocks' definition references (tests/kernels/selection/test_selection.py)
with the kernel's products.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.selection.blocks import index_products_torch, select_blocks
from kvtune.kernels.selection.decode_scores import index_products, tile_vectors
from tests.kernels.selection.test_selection import (
    _bounds_reference,
    _means_reference,
    _reference,
    _stream,
)

# Each test runs with the CPU kernels and with the torch paths alone.
pytestmark = pytest.mark.usefixtures("cpu_paths")

FORMATS = {
    "fp32": KVFormat("fp32"),
    "fp16": KVFormat("fp16"),
    "fp8_g32": KVFormat("fp8", 32, "fp16"),
    "int8_g32": KVFormat("int8", 32, "fp16"),
    "int4_g32": KVFormat("int4", 32, "fp16"),
    "fp4_g16_e4m3": KVFormat("fp4", 16, "e4m3"),
}
BLOCK = 16


def _index(
    fmt: KVFormat,
    lengths: list[int],
    kv_heads: int,
    head_dim: int,
    generator: torch.Generator,
) -> PagedStream:
    """An index stream whose sequences own shuffled blocks of both pools (K: maxima, V: minima,
    as a bounds index holds them; a means index reads K only), NaN in every slot past each
    sequence's length."""
    blocks = [math.ceil(n / BLOCK) for n in lengths]
    total = sum(blocks) + 2  # two blocks nobody owns
    pools = [KVPool.allocate(fmt, total, BLOCK, kv_heads, head_dim) for _ in range(2)]
    order = torch.randperm(total, generator=generator)[: sum(blocks)]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    first = 0
    for seq, count in enumerate(blocks):
        table[seq, :count] = order[first : first + count].to(torch.int32)
        first += count
    # Bounds hold a block's channel maxima over its minima: K stays above V by far more than
    # any format's rounding, as bounds read back must.
    middle = torch.randn(total * BLOCK, kv_heads, head_dim, generator=generator) * 3
    spread = 4 + torch.rand(total * BLOCK, kv_heads, head_dim, generator=generator) * 2
    for pool, values in zip(pools, (middle + spread, middle - spread), strict=True):
        write_vectors_ref(pool, torch.arange(pool.num_slots), values)
    for seq, length in enumerate(lengths):
        owned = table[seq, : blocks[seq]].long()
        past = (owned[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[length:]
        if len(past) and not fmt.token_group > 1:  # a per-channel block is written whole
            for pool in pools:
                write_vectors_ref(pool, past, torch.full((len(past), kv_heads, head_dim), math.nan))
    return PagedStream(
        pools[0],
        pools[1],
        table,
        torch.tensor(lengths, dtype=torch.int32),
        torch.zeros(len(lengths), dtype=torch.int32),
    )


def _products_reference(q: torch.Tensor, index: PagedStream, kind: str) -> list[torch.Tensor]:
    """Per sequence fp32 [Hq, length] from the definition, vector by vector."""
    q_heads, kv_heads = q.shape[1], index.num_kv_heads
    out = []
    for seq, length in enumerate(index.lengths.tolist()):
        rows = torch.zeros(q_heads, length)
        for i in range(length):
            slot = torch.tensor([int(index.block_table[seq, i // BLOCK]) * BLOCK + i % BLOCK])
            hi, lo = read_vectors_ref(index.k, slot)[0], read_vectors_ref(index.v, slot)[0]
            assert (hi >= lo).all()  # the data are bounds
            for head in range(q_heads):
                kv_head = head // (q_heads // kv_heads)
                query = q[seq, head].double()
                if kind == "bounds":
                    upper = torch.maximum(
                        query * hi[kv_head].double(), query * lo[kv_head].double()
                    )
                    rows[head, i] = upper.sum()
                else:
                    rows[head, i] = query @ hi[kv_head].double()
        out.append(rows)
    return out


# The Triton kernel writes zeros past a sequence's length; the torch twin leaves them undefined.
PRODUCTS = {"triton": index_products, "torch": index_products_torch}


@pytest.mark.parametrize("path", list(PRODUCTS))
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", ["bounds", "means"])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 128), (2, 2, 64)])
def test_products_match_the_definition(path, fmt, kind, q_heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(len(fmt) + q_heads + head_dim)
    lengths = [2 * tile_vectors(head_dim) + 7, 5, 0, 2 * BLOCK]  # tiles, ragged, empty, blocks
    index = _index(FORMATS[fmt], lengths, kv_heads, head_dim, generator)
    q = torch.randn(len(lengths), q_heads, head_dim, generator=generator)
    products = PRODUCTS[path](q, index, max(lengths), kind)
    assert products.shape == (len(lengths), q_heads, max(lengths))
    for seq, expected in enumerate(_products_reference(q, index, kind)):
        length = lengths[seq]
        torch.testing.assert_close(products[seq, :, :length], expected, rtol=1e-5, atol=1e-4)
        if path == "triton":
            assert not products[seq, :, length:].any()  # nothing stored past a length


@pytest.mark.parametrize("path", list(PRODUCTS))
def test_per_channel_scales_shared_by_a_block_are_read_by_row(path):
    """A token-grouped format (one scale and zero point per channel per block of 16) reads the
    scale row of each vector's block."""
    generator = torch.Generator().manual_seed(7)
    fmt = KVFormat("int4", 1, "fp16", token_group=BLOCK)
    index = _index(fmt, [3 * BLOCK, BLOCK], 3, 64, generator)
    q = torch.randn(2, 9, 64, generator=generator)
    products = PRODUCTS[path](q, index, 3 * BLOCK, "bounds")
    for seq, expected in enumerate(_products_reference(q, index, "bounds")):
        torch.testing.assert_close(
            products[seq, :, : expected.shape[1]], expected, rtol=1e-5, atol=1e-4
        )


@pytest.mark.parametrize("lengths", [[24, 8, 16], [24]])  # one sequence: no validity mask
@pytest.mark.parametrize("kind", ["bounds", "means", "summaries"])
def test_the_kernel_and_torch_pick_the_definitions_blocks(kind, lengths):
    """select_blocks with either decode path picks what the definition picks."""
    generator = torch.Generator().manual_seed(30)
    stream = _stream(lengths, generator)
    seqs = list(range(len(lengths)))
    q = torch.randn(len(lengths), 6, 16, generator=generator)
    starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
    per_block = 2 if kind == "summaries" else 1
    if kind == "bounds":
        expected = _bounds_reference(q, stream, 3)
    elif kind == "means":
        expected = _means_reference(q, stream, 3)
    else:
        expected = _reference(q, seqs, stream, per_block, 3, 0.25)
    for products in (index_products_torch, index_products):
        chosen = select_blocks(q, None, starts, stream, per_block, 3, 0.25, kind, products)
        assert torch.equal(chosen, expected), products.__name__


def test_a_query_of_the_wrong_shape_is_refused():
    generator = torch.Generator().manual_seed(1)
    index = _index(FORMATS["fp16"], [BLOCK], 3, 64, generator)
    with pytest.raises(ValueError, match="q.shape"):
        index_products(torch.zeros(1, 9, 32), index, BLOCK, "bounds")
    with pytest.raises(ValueError, match="num_q_heads"):
        index_products(torch.zeros(1, 8, 64), index, BLOCK, "bounds")
