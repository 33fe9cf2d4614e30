"""Query-aware block selection for CSA (Quest / NSA style): which older blocks a query reads
exactly.

Every older block (outside sinks and window) keeps a small device index. Each KV head of a
query chooses on its own (the heads that retrieve and the heads that attend locally want
different blocks) the csa_topk blocks it scores best among those it sees, and reads them
exactly; the summaries of those blocks are then hidden from it, so that no block counts twice.
Three indexes:
- bounds (Quest): one slot a block holding the per-channel max (in K) and min (in V) of its
  keys, in the cache's rotated space or in the model's basis (a separate index pool), stored
  rounded outward (`write_key_bounds`): read back, hi >= every key of the block >= lo, channel
  by channel. So sum_d max(q_d hi_d, q_d lo_d) bounds q.k from above for every key of the
  block, and a block holding the one key a query matches scores high whatever its other keys;
  a query head group scores a block by the largest bound of its query heads.
- means: one K slot a block holding the mean of its cached (post-RoPE) keys, at half the
  bound's bytes; q.mean is the mean logit the block's keys get. On SmolLM2 it ranks blocks by
  the attention mass they draw better than the bound does (`benchmarks.selection_scoring`),
  but a mean dilutes the one token that retrieval reads next: end to end it loses multikey
  and codes (RESULTS.md, "Block-scoring rules"), so bounds stay the default. A query head group
  scores a block by the largest q.mean of its query heads.
- summaries (NSA's compressed branch): the block's pooled keys. Each query head's softmax over
  all summaries it sees, summed over the block's summaries and the KV head's query heads. No
  extra bytes, but the mean of r keys dilutes the one key a query looks for.

Selection reads only the index, a 1 / block_size or 1 / r fraction of the older cache, so
decode never scores or gathers the exact older cache. Both backends turn products into picks
here; a decode step's products come from the backend (`index_products_torch`, or the Triton
kernel of `kvtune.kernels.selection.decode_scores` that reads the index in place), a prefill step's
from torch (one call a chunk, with the visibility rules of attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import group_keys
from kvtune.kernels.attention.query_groups import query_groups
from kvtune.kernels.cache.pool import KVPool, read_blocks_into, read_blocks_ref, write_vectors_ref
from kvtune.kernels.formats.directed_rounding import (
    ROUND_DOWN,
    ROUND_NEAREST,
    ROUND_UP,
    rounds_per_element,
)
from kvtune.kernels.formats.rotation import Rotation, unrotate
from kvtune.kernels.native.read_blocks import index_products_native


def _index_keys(keys: KVPool, blocks: torch.Tensor, rotation: Rotation | None) -> torch.Tensor:
    """fp32 [M, block_size, H, D]: the keys of `blocks` in the index's space: the cache's, or
    the model's basis when the cache is rotated by `rotation` (queries are then scored
    unrotated)."""
    vectors = read_blocks_ref(keys, blocks.long()[:, None])
    return vectors if rotation is None else unrotate(vectors, rotation)


def write_key_bounds(
    keys: KVPool,
    blocks: torch.Tensor,
    hi_pool: KVPool,
    lo_pool: KVPool,
    slots: torch.Tensor,
    rotation: Rotation | None = None,
) -> None:
    """The per-channel max and min of the keys of each of `blocks`, written to slots[i] of
    hi_pool and lo_pool in their formats, in the index's space (`_index_keys`), the max rounded
    up and the min rounded down: read back, hi >= every key of the block >= lo, element for
    element, so that Quest's score bounds q.k. That holds in every separate index dtype
    (CSA_INDEX_DTYPES) and in the layer formats of an auto index with group scales; a layer
    format with one tensor scale clips a value past its range, and Lloyd-Max codes (rounded a
    whole group at once) are stored to nearest (`kvtune.kernels.formats.directed_rounding`)."""
    vectors = _index_keys(keys, blocks, rotation)
    write_vectors_ref(hi_pool, slots, vectors.amax(dim=1), _outward(hi_pool, ROUND_UP))
    write_vectors_ref(lo_pool, slots, vectors.amin(dim=1), _outward(lo_pool, ROUND_DOWN))


def _outward(pool: KVPool, rounding: str) -> str:
    """rounding where the pool's format rounds element by element, else to nearest."""
    return rounding if rounds_per_element(pool.fmt) else ROUND_NEAREST


def write_key_means(
    keys: KVPool,
    blocks: torch.Tensor,
    means: KVPool,
    slots: torch.Tensor,
    rotation: Rotation | None = None,
) -> None:
    """The mean key of each of `blocks`, written to slots[i] of `means` in its format, in the
    index's space (`_index_keys`)."""
    write_vectors_ref(means, slots, _index_keys(keys, blocks, rotation).mean(dim=1))


def _head_products(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[S, C, Hkv, g, L]: every query head dotted with its KV head's keys. queries
    [S, C, Hkv, g, D]; keys [S, L, Hkv, D]. One batched matmul: a decode step scores every
    layer, where einsum's planning cost as much as the product."""
    seqs, count, kv_heads, group, head_dim = queries.shape
    rows = queries.permute(0, 2, 1, 3, 4).reshape(seqs, kv_heads, count * group, head_dim)
    products = rows @ keys.permute(0, 2, 3, 1)
    return products.view(seqs, kv_heads, count, group, -1).transpose(1, 2)


def _rule_products(
    kind: str, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """[S, C, Hkv, g, L]: what each query head's rule scores an index vector by (the upper
    bound of q.k for bounds, q.k otherwise). queries [S, C, Hkv, g, D]; keys, values
    [S, L, Hkv, D] (values: a bounds index's minima)."""
    if kind != "bounds":
        return _head_products(queries, keys)
    upper = _head_products(queries.clamp(min=0), keys)
    upper += _head_products(queries.clamp(max=0), values)
    return upper


def index_products_torch(
    q: torch.Tensor, index: PagedStream, length: int, kind: str
) -> torch.Tensor:
    """fp32 [S, Hq, length]: each decode query q [S, Hq, D] (one a sequence) with each of its
    sequence's index vectors by the rule of `kind`; undefined past a sequence's length (the
    rule masks those). The torch twin of `kvtune.kernels.selection.decode_scores.index_products`.
    A bounds index is one batched product: the maxima and minima as two halves of one buffer
    against the query's positive and negative parts, then summed (two products and their sum
    cost more calls than the data on a CPU). On a CPU, the native kernel reads and dots the
    index in one pass."""
    seqs, num_heads, head_dim = q.shape
    kv_heads, block_size = index.num_kv_heads, index.block_size
    blocks = -(-length // block_size)
    table = index.block_table[:, :blocks]
    low = index.v if kind == "bounds" else None
    products = index_products_native(q, index.k, low, table, length)
    if products is not None:
        return products
    table = table.clamp(min=0).to(index.k.codes.device)
    pools = (index.k, index.v) if kind == "bounds" else (index.k,)
    vectors = torch.empty(
        len(pools), seqs, kv_heads, blocks * block_size, head_dim, device=q.device
    )
    for half, pool in zip(vectors, pools, strict=True):
        read_blocks_into(pool, table, half)
    queries = q.float().view(1, seqs, kv_heads, num_heads // kv_heads, head_dim)
    if kind == "bounds":
        queries = torch.cat((queries.clamp(min=0), queries.clamp(max=0)))
    products = queries @ vectors[..., :length, :].transpose(-1, -2)  # [halves, S, Hkv, g, L]
    return products.sum(0).view(seqs, num_heads, length)


# Decode products of (q, index, longest length, kind): `index_products_torch` or the Triton
# launcher `kvtune.kernels.selection.decode_scores.index_products`.
IndexProducts = Callable[[torch.Tensor, PagedStream, int, str], torch.Tensor]


def select_blocks(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    index: PagedStream,
    vectors_per_block: int,
    topk: int,
    scale: float,
    kind: str = "summaries",
    decode_products: IndexProducts = index_products_torch,
) -> torch.Tensor:
    """bool [Nq, Hkv, blocks]: the older blocks each packed query reads exactly, per KV head.

    q: [Nq, Hq, D] in the index's space; index: the step's stream of block bounds (kind
    "bounds", one vector a block), mean keys (kind "means", one key a block; its values are not
    read) or summaries (kind "summaries", block j's at
    j * vectors_per_block ... (j + 1) * vectors_per_block - 1); blocks: the most any sequence
    of the batch has. A query picks among the blocks whose index vectors it sees (decode: all
    of its sequence's), at most topk of them. decode_products: how a decode step computes its
    products (the torch path or the Triton kernel); a prefill step's are computed in torch.
    """
    length = int(index.lengths.max())
    num_blocks = math.ceil(length / vectors_per_block)
    shape = (q.shape[0], index.num_kv_heads, num_blocks)
    rule = _BlockRule(kind, vectors_per_block, topk, scale)
    if q_positions is None and num_blocks:  # decode: one query a sequence, all vectors visible
        products = decode_products(q, index, length, kind)
        kv_heads = index.num_kv_heads
        products = products.view(q.shape[0], 1, kv_heads, q.shape[1] // kv_heads, length)
        valid = None  # one sequence: its length is the longest, it sees every vector
        if index.num_seqs > 1:
            valid = (torch.arange(length, device=q.device) < index.lengths[:, None])[:, None]
        return rule.choose(products, valid)[:, 0]  # a decode index holds whole blocks
    selected = torch.zeros(shape, dtype=torch.bool, device=q.device)
    if num_blocks == 0:
        return selected
    for group in query_groups(q_seq_starts):
        gathered = group_keys(index, group, q_positions)
        if gathered is None:
            continue
        queries = _grouped_queries(q[group.rows], gathered.keys.shape[2])
        visible = gathered.visible[:, 0]  # [S, C, L]: an index stream has no query_mask
        products = _rule_products(kind, queries, gathered.keys, gathered.values)
        chosen = rule.choose(products, visible)
        selected[group.rows.flatten(), :, : chosen.shape[-1]] = chosen.flatten(0, 1)
    return selected


def _grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """fp32 [S, C, Hkv, g, D] from queries [S, C, Hq, D] or, one a sequence, [S, Hq, D]."""
    num_heads, head_dim = q.shape[-2:]
    return q.float().view(q.shape[0], -1, kv_heads, num_heads // kv_heads, head_dim)


@dataclass(frozen=True)
class _BlockRule:
    """How a query scores and picks blocks on an index (see `select_blocks`)."""

    kind: str
    vectors_per_block: int
    topk: int
    scale: float

    def choose(self, products: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """bool [S, C, Hkv, blocks]: each query's picks. products [S, C, Hkv, g, L]
        (`_rule_products`); visible bool [S, C, L], None when every query sees every vector
        (a decode step of one sequence: a few small ops fewer in every layer). Bounds and
        means: a KV head scores a vector by its query heads' largest product; summaries: by
        the attention its query heads give it (each head's softmax over the summaries it
        sees, summed)."""
        seqs, _, kv_heads, _, length = products.shape
        if self.kind == "summaries":
            logits = products * self.scale
            if visible is not None:
                logits = logits.masked_fill(~visible[:, :, None, None, :], -math.inf)
            scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=3)
        else:
            scores = products.amax(dim=3)
        per_block = self.vectors_per_block
        blocks = length // per_block
        block_scores = scores.view(seqs, -1, kv_heads, blocks, per_block)
        block_scores = block_scores.sum(-1) if per_block > 1 else block_scores.squeeze(-1)
        if visible is not None:
            block_seen = visible.view(seqs, -1, 1, blocks, per_block).all(-1)
            block_scores = block_scores.masked_fill(~block_seen, -math.inf)
        best = block_scores.topk(min(self.topk, blocks), dim=-1).indices
        chosen = torch.zeros_like(block_scores, dtype=torch.bool).scatter(-1, best, True)
        return chosen if visible is None else chosen & block_seen
