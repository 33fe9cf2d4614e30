"""Query-aware block selection for CSA (Quest / NSA style): which older blocks a query reads
exactly.

Every older block (outside sinks and window) is pooled into block_size / r summary keys that
stay on the device; they serve as the index. A query scores a block by the attention its
heads give to that block's summaries (softmax over all summaries the query sees, summed over
the block's summaries and over every query head: one choice per query, shared by the KV heads,
so that a selected block is fetched once), and reads exactly the csa_topk best blocks it sees;
the summaries of those blocks are then hidden from it, so that no block counts twice.

This is the torch path (both backends call it: it reads only the summaries, a block_size / r
fraction of the older cache). Decode therefore never scores or gathers the exact older cache.
"""

from __future__ import annotations

import math

import torch

from kernels.attention import PagedStream
from kernels.attention_torch import group_keys, query_groups


def select_blocks(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    summaries: PagedStream,
    summaries_per_block: int,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """bool [Nq, blocks]: the older blocks each packed query reads exactly.

    q: [Nq, Hq, D] in the cache's (rotated) space; summaries: the step's summary stream, block
    j's summaries at j * summaries_per_block ... (j + 1) * summaries_per_block - 1; blocks:
    the most any sequence of the batch has pooled. A query picks among the blocks whose
    summaries it sees (decode: all of its sequence's), at most topk of them.
    """
    num_blocks = math.ceil(int(summaries.lengths.max()) / summaries_per_block)
    selected = torch.zeros(q.shape[0], num_blocks, dtype=torch.bool, device=q.device)
    if num_blocks == 0:
        return selected
    num_heads, head_dim = q.shape[1], q.shape[2]
    for group in query_groups(q_seq_starts):
        gathered = group_keys(summaries, group, q_positions)
        if gathered is None:
            continue
        seqs, length, kv_heads, _ = gathered.keys.shape
        queries = q[group.rows].float()  # [S, C, Hq, D]
        per_kv = queries.view(seqs, -1, kv_heads, num_heads // kv_heads, head_dim)
        logits = torch.einsum("schgd,slhd->schgl", per_kv, gathered.keys) * scale
        visible = gathered.visible  # [S, C, L]
        logits = logits.masked_fill(~visible[:, :, None, None, :], -math.inf)
        mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(2, 3))  # [S, C, L]
        blocks = length // summaries_per_block
        block_mass = mass.view(seqs, -1, blocks, summaries_per_block).sum(-1)
        block_seen = visible.view(seqs, -1, blocks, summaries_per_block).all(-1)
        scores = block_mass.masked_fill(~block_seen, -1.0)
        best = scores.topk(min(topk, blocks), dim=-1).indices
        chosen = torch.zeros_like(block_seen).scatter(-1, best, True) & block_seen
        selected[group.rows.flatten(), :blocks] = chosen.flatten(0, 1)
    return selected
