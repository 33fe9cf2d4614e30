"""Query-aware block selection against a loop written from its definition: per query and KV
head, the softmax of each query head over the summaries it sees, summed over the query heads
of that KV head and over each block's summaries; the topk best blocks it sees."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import Rotation
from kvtune.kernels.selection.blocks import select_blocks, write_key_bounds, write_key_means

BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM = 8, 2, 6, 16


def _stream(lengths: list[int], generator: torch.Generator, stride: int = 1) -> PagedStream:
    """Random K and V pools of their own, K above V channel by channel as a bounds index holds
    maxima in K and minima in V (a rule reading one for the other chooses otherwise); stride:
    tokens a vector stands for."""
    blocks_per_seq = max(math.ceil(n / BLOCK) for n in lengths)
    slots = len(lengths) * blocks_per_seq * BLOCK
    middle = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=generator) * 2
    spread = torch.rand(slots, KV_HEADS, HEAD_DIM, generator=generator) * 2
    pools = []
    for values in (middle + spread, middle - spread):
        pool = KVPool.allocate(
            KVFormat("fp32"), len(lengths) * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM
        )
        write_vectors_ref(pool, torch.arange(pool.num_slots), values)
        pools.append(pool)
    table = torch.arange(len(lengths) * blocks_per_seq, dtype=torch.int32).view(len(lengths), -1)
    return PagedStream(
        *pools,
        table,
        torch.tensor(lengths, dtype=torch.int32),
        torch.zeros(len(lengths), dtype=torch.int32),
        stride,
    )


def _reference(q, seq_of_query, stream, per_block, topk, scale) -> torch.Tensor:
    rows = []
    width = max(int(n) for n in stream.lengths) // per_block
    for query, seq in zip(q, seq_of_query, strict=True):
        length = int(stream.lengths[seq])
        slots = torch.tensor(
            [int(stream.block_table[seq, i // BLOCK]) * BLOCK + i % BLOCK for i in range(length)]
        )
        keys = read_vectors_ref(stream.k, slots)  # [L, Hkv, D]
        mass = torch.zeros(KV_HEADS, length)
        for head in range(Q_HEADS):
            kv_head = head // (Q_HEADS // KV_HEADS)
            mass[kv_head] += torch.softmax(keys[:, kv_head] @ query[head] * scale, dim=0)
        chosen = torch.zeros(KV_HEADS, width, dtype=torch.bool)
        for kv_head in range(KV_HEADS):
            per = mass[kv_head].view(-1, per_block).sum(-1)
            chosen[kv_head, per.argsort(descending=True)[:topk]] = True
        rows.append(chosen)
    return torch.stack(rows)


@pytest.mark.parametrize("per_block", [2, 4])
@pytest.mark.parametrize("topk", [1, 3, 10])
def test_decode_selection_matches_the_definition(per_block, topk):
    generator = torch.Generator().manual_seed(per_block * 10 + topk)
    stream = _stream([24, 8, 16], generator)
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    chosen = select_blocks(q, None, starts, stream, per_block, topk, 0.25)
    expected = _reference(q, [0, 1, 2], stream, per_block, topk, 0.25)
    assert torch.equal(chosen, expected)


def test_prefill_queries_choose_only_among_summaries_they_see():
    """A query at position p sees summary i (covering positions 2i, 2i + 1) once p >= 2i + 1."""
    generator = torch.Generator().manual_seed(1)
    stream = _stream([16], generator)
    stream = PagedStream(
        stream.k, stream.v, stream.block_table, stream.lengths, stream.start_positions, 2
    )
    positions = torch.arange(40, dtype=torch.int32)
    q = torch.randn(40, Q_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, 40], dtype=torch.int32)
    chosen = select_blocks(q, positions, starts, stream, 4, 2, 0.25)  # blocks of 4 summaries
    for p in range(40):
        seen_blocks = sum(1 for b in range(4) if 2 * (4 * b + 3) + 1 <= p)
        for kv_head in range(KV_HEADS):
            assert int(chosen[p, kv_head].sum()) == min(2, seen_blocks), p
        assert not chosen[p, :, seen_blocks:].any(), p


def _bounds_reference(q, stream, topk, pick=torch.maximum) -> torch.Tensor:
    """Quest's rule from its definition: per query head, sum_d max(q_d hi_d, q_d lo_d) with
    hi/lo each block's stored bounds (K holds hi, V holds lo); a KV head takes its query
    heads' largest; the topk best blocks. pick=torch.minimum: what a rule that read hi for lo
    would score (the lower bound)."""
    rows = []
    for seq, query in enumerate(q):
        length = int(stream.lengths[seq])
        slots = torch.tensor(
            [int(stream.block_table[seq, i // BLOCK]) * BLOCK + i % BLOCK for i in range(length)]
        )
        hi, lo = read_vectors_ref(stream.k, slots), read_vectors_ref(stream.v, slots)
        chosen = torch.zeros(KV_HEADS, max(int(n) for n in stream.lengths), dtype=torch.bool)
        for kv_head in range(KV_HEADS):
            best = torch.full((length,), -math.inf)
            for head in range(Q_HEADS):
                if head // (Q_HEADS // KV_HEADS) != kv_head:
                    continue
                upper = pick(query[head] * hi[:, kv_head], query[head] * lo[:, kv_head])
                best = torch.maximum(best, upper.sum(-1))
            chosen[kv_head, best.argsort(descending=True)[:topk]] = True
        rows.append(chosen)
    return torch.stack(rows)


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("topk", [1, 4])
def test_bounds_selection_matches_quest_rule(topk, prefill):
    """Decode scores in one batched product, prefill chunk by chunk: both by Quest's rule,
    maxima from K and minima from V (distinct pools: a rule that swapped them would score the
    lower bound, which chooses otherwise, as the last check shows). A prefill query far past
    the index sees every block."""
    generator = torch.Generator().manual_seed(topk)
    stream = _stream([24, 8, 16], generator, stride=BLOCK)
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    positions = torch.full((3,), 1000, dtype=torch.int32) if prefill else None
    chosen = select_blocks(q, positions, starts, stream, 1, topk, 0.25, "bounds")
    assert torch.equal(chosen, _bounds_reference(q, stream, topk))
    assert not torch.equal(chosen, _bounds_reference(q, stream, topk, torch.minimum))


def _with_nan_past_lengths(stream: PagedStream) -> PagedStream:
    """The stream with NaN in every slot of its blocks past each sequence's length (what a
    reused block may hold there), the K and V pools both."""
    for seq, length in enumerate(stream.lengths.tolist()):
        blocks = stream.block_table[seq].long()
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[length:]
        garbage = torch.full((len(slots), KV_HEADS, HEAD_DIM), math.nan)
        write_vectors_ref(stream.k, slots, garbage)
        write_vectors_ref(stream.v, slots, garbage)
    return stream


@pytest.mark.parametrize("kind", ["bounds", "means", "summaries"])
def test_decode_selection_ignores_nan_past_each_length(kind):
    """Rows past a sequence's length are not zeroed before scoring (decode skips that): NaN
    there must neither be chosen nor change what is."""
    generator = torch.Generator().manual_seed(20)
    stream = _stream([24, 8, 13], generator)
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    per_block = 2 if kind == "summaries" else 1
    clean = select_blocks(q, None, starts, stream, per_block, 4, 0.25, kind)
    dirty = select_blocks(q, None, starts, _with_nan_past_lengths(stream), per_block, 4, 0.25, kind)
    assert torch.equal(dirty, clean)
    if kind == "bounds":
        assert torch.equal(dirty, _bounds_reference(q, stream, 4))


def _means_reference(q, stream, topk) -> torch.Tensor:
    """Per query head the dot product of q with each block's stored mean key (K); a KV head
    takes its query heads' largest; the topk best blocks."""
    rows = []
    for seq, query in enumerate(q):
        length = int(stream.lengths[seq])
        chosen = torch.zeros(KV_HEADS, max(int(n) for n in stream.lengths), dtype=torch.bool)
        for kv_head in range(KV_HEADS):
            scores = []
            for block in range(length):
                slot = int(stream.block_table[seq, block // BLOCK]) * BLOCK + block % BLOCK
                mean = read_vectors_ref(stream.k, torch.tensor([slot]))[0, kv_head]
                heads = range(kv_head * Q_HEADS // KV_HEADS, (kv_head + 1) * Q_HEADS // KV_HEADS)
                scores.append(max(float(query[head] @ mean) for head in heads))
            chosen[kv_head, torch.tensor(scores).argsort(descending=True)[:topk]] = True
        rows.append(chosen)
    return torch.stack(rows)


@pytest.mark.parametrize("topk", [1, 4])
def test_means_selection_matches_its_rule(topk):
    generator = torch.Generator().manual_seed(10 + topk)
    stream = _stream([24, 8, 16], generator)
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    chosen = select_blocks(q, None, starts, stream, 1, topk, 0.25, "means")
    assert torch.equal(chosen, _means_reference(q, stream, topk))
    # Another V half (as a bounds index holds its minima in V) changes nothing, while the
    # bounds rule on it chooses otherwise.
    other_v = dataclasses.replace(stream, v=_stream([24, 8, 16], generator).k)
    assert torch.equal(select_blocks(q, None, starts, other_v, 1, topk, 0.25, "means"), chosen)
    assert not torch.equal(_bounds_reference(q, other_v, topk), chosen)


@pytest.mark.parametrize("rotated", [False, True])
def test_key_means_are_the_mean_of_their_block(rotated):
    """The slot holds the channel-wise mean of its block's keys, in the model's basis when the
    cache is rotated by an orthogonal Q (made here by QR) and the rotation is given."""
    generator = torch.Generator().manual_seed(5)
    basis, _ = torch.linalg.qr(
        torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64)
    )
    keys = KVPool.allocate(KVFormat("fp32"), 3, BLOCK, KV_HEADS, HEAD_DIM)
    model_keys = torch.randn(keys.num_slots, KV_HEADS, HEAD_DIM, generator=generator)
    cached = (model_keys.double() @ basis).float() if rotated else model_keys
    write_vectors_ref(keys, torch.arange(keys.num_slots), cached)
    means = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, KV_HEADS, HEAD_DIM)
    rotation = Rotation(basis.float()) if rotated else None
    write_key_means(keys, torch.tensor([2, 0]), means, torch.tensor([5, 1]), rotation)
    for block, slot in ((2, 5), (0, 1)):
        expected = model_keys[block * BLOCK : (block + 1) * BLOCK].double().mean(dim=0)
        got = read_vectors_ref(means, torch.tensor([slot]))[0]
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


def test_key_bounds_hold_every_key_of_their_block():
    """hi >= every key >= lo, channel by channel, and both are attained (fp32 pools)."""
    generator = torch.Generator().manual_seed(3)
    keys = KVPool.allocate(KVFormat("fp32"), 3, BLOCK, KV_HEADS, HEAD_DIM)
    vectors = torch.randn(keys.num_slots, KV_HEADS, HEAD_DIM, generator=generator)
    write_vectors_ref(keys, torch.arange(keys.num_slots), vectors)
    hi = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, KV_HEADS, HEAD_DIM)
    lo = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, KV_HEADS, HEAD_DIM)
    write_key_bounds(keys, torch.tensor([2, 0]), hi, lo, torch.tensor([5, 1]))
    for block, slot in ((2, 5), (0, 1)):
        mine = vectors[block * BLOCK : (block + 1) * BLOCK]
        top = read_vectors_ref(hi, torch.tensor([slot]))[0]
        bottom = read_vectors_ref(lo, torch.tensor([slot]))[0]
        assert torch.equal(top, mine.max(dim=0).values)
        assert torch.equal(bottom, mine.min(dim=0).values)


def test_key_bounds_of_a_rotated_cache_are_taken_in_the_models_basis():
    """A cache holding keys x Q (Q a random orthogonal matrix, made here by QR) yields the
    per-channel max and min of x itself when its rotation is given: the model's basis, where
    RoPE's outlier channels keep Quest's bound sharp."""
    generator = torch.Generator().manual_seed(4)
    basis, _ = torch.linalg.qr(
        torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64)
    )
    keys = KVPool.allocate(KVFormat("fp32"), 2, BLOCK, KV_HEADS, HEAD_DIM)
    model_keys = torch.randn(keys.num_slots, KV_HEADS, HEAD_DIM, generator=generator)
    cached = (model_keys.double() @ basis).float()
    write_vectors_ref(keys, torch.arange(keys.num_slots), cached)
    hi = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, KV_HEADS, HEAD_DIM)
    lo = KVPool.allocate(KVFormat("fp32"), 1, BLOCK, KV_HEADS, HEAD_DIM)
    rotation = Rotation(basis.float())
    write_key_bounds(keys, torch.tensor([1]), hi, lo, torch.tensor([3]), rotation)
    mine = model_keys[BLOCK : 2 * BLOCK]
    top = read_vectors_ref(hi, torch.tensor([3]))[0]
    bottom = read_vectors_ref(lo, torch.tensor([3]))[0]
    torch.testing.assert_close(top, mine.max(dim=0).values, atol=1e-5, rtol=0)
    torch.testing.assert_close(bottom, mine.min(dim=0).values, atol=1e-5, rtol=0)
    # Without the rotation they are the cached (rotated) keys' bounds, a different vector.
    write_key_bounds(keys, torch.tensor([1]), hi, lo, torch.tensor([3]))
    assert (read_vectors_ref(hi, torch.tensor([3]))[0] - top).abs().max() > 0.1
