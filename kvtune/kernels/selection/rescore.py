"""Two-stage CSA selection: the index shortlists, the exact keys decide.

A block's index vector (key bounds, mean key or summaries) ranks it by one number per KV head
that the block's other keys blur, so the block holding the one key a query retrieves can fall
below the budget while still ranking in its top few times the budget (Qwen2.5 at 8K: whole-
block bounds hold the pass key's block in 0.55-0.75 of the (layer, KV head) pairs that need
it at top 64, and 0.85-0.97 once the best 4 x 64 are rescored; RESULTS.md, "Block-scoring
rules"). So the index shortlists csa_rescore x csa_topk blocks and each KV head keeps the
csa_topk whose exact keys give the largest logit to any of its query heads (Quest's criterion
without the bound's slack).

The exact keys are the host tier's: a decode step reads only the shortlisted blocks there (the
union of its KV heads' shortlists, each block once), so its bytes grow with the shortlist, not
the context; on a CUDA device they are the K codes moved from pinned host memory. A prefill
chunk scores its queries against the host tier where it lies (one product, as attention's),
with the visibility rules of attention.
"""

from __future__ import annotations

import math

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import group_keys
from kvtune.kernels.attention.query_groups import query_groups
from kvtune.kernels.cache.pool import read_blocks_into


def rescore_decode(
    q: torch.Tensor, host: PagedStream, shortlist: torch.Tensor, topk: int
) -> tuple[torch.Tensor, int]:
    """(bool [S, Hkv, blocks] picks, blocks read): each decode query's topk blocks among its
    shortlist by exact max logit. q [S, Hq, D] in the host tier's space (the cache's rotated
    space); shortlist bool [S, Hkv, blocks] (index order: block j is the host stream's j-th)."""
    seqs, kv_heads, _ = shortlist.shape
    either = shortlist.any(dim=1)  # [S, blocks]: each block read once for all its KV heads
    counts = either.sum(dim=1).tolist()  # one host sync for both the width and the total
    width = max(counts)
    if width == 0:
        return shortlist, 0
    read = either.to(torch.int8).topk(width, dim=-1, sorted=False).indices  # [S, U]
    bs = host.block_size
    ids = host.block_table.long().gather(1, read.to(host.block_table.device))
    keys = torch.empty(seqs, kv_heads, width * bs, q.shape[-1], device=q.device)
    read_blocks_into(host.k, ids.to(host.k.codes.device), keys)
    queries = q.float().view(seqs, kv_heads, -1, q.shape[-1])  # [S, Hkv, g, D]
    logits = queries @ keys.transpose(-1, -2)  # [S, Hkv, g, U * bs]
    best = logits.amax(dim=2).view(seqs, kv_heads, width, bs).amax(dim=-1)  # [S, Hkv, U]
    listed = shortlist.gather(2, read[:, None, :].expand(-1, kv_heads, -1))
    best = best.masked_fill(~listed, -math.inf)
    keep = best.topk(min(topk, width), dim=-1).indices
    kept = torch.zeros_like(listed).scatter(-1, keep, True) & listed
    picks = torch.zeros_like(shortlist)
    picks.scatter_(2, read[:, None, :].expand(-1, kv_heads, -1), kept)
    return picks, sum(counts)


def rescore_prefill(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    q_seq_starts: torch.Tensor,
    host: PagedStream,
    shortlist: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """bool [Nq, Hkv, blocks]: each packed prefill query's topk blocks among its shortlist by
    the largest exact logit it may see in them (q [Nq, Hq, D] in the host tier's space)."""
    picks = torch.zeros_like(shortlist)
    bs = host.block_size
    for group in query_groups(q_seq_starts):
        gathered = group_keys(host, group, q_positions)
        if gathered is None:
            continue
        seqs, count = group.rows.shape
        length, kv_heads = gathered.keys.shape[1], gathered.keys.shape[2]
        queries = q[group.rows].float().view(seqs, count, kv_heads, -1, q.shape[-1])
        keys = gathered.keys.permute(0, 2, 3, 1)  # [S, Hkv, D, L]
        logits = torch.einsum("schgd,shdl->schgl", queries, keys).amax(dim=3)  # [S, C, Hkv, L]
        logits = logits.masked_fill(~gathered.visible.transpose(1, 2), -math.inf)
        span = -(-length // bs)
        padded = torch.nn.functional.pad(logits, (0, span * bs - length), value=-math.inf)
        best = padded.view(seqs, count, kv_heads, span, bs).amax(dim=-1)
        listed = shortlist[group.rows.flatten(), :, :span].view(seqs, count, kv_heads, span)
        best = best.masked_fill(~listed, -math.inf)
        keep = best.topk(min(topk, span), dim=-1).indices
        kept = torch.zeros_like(listed).scatter(-1, keep, True) & listed & (best > -math.inf)
        picks[group.rows.flatten(), :, :span] = kept.flatten(0, 1)
    return picks
