"""The attention each window block receives, for CSA's importance-kept blocks (H2O / SnapKV).

A block's importance is the softmax mass the queries that already ran gave its tokens while it
sat in the window: each query's softmax over the exact window it sees (sinks and summaries
left out, so that a query spreads one unit over the tokens that compete to be kept), summed
over the query heads of each KV head. It reads only the window streams, which attention reads
anyway, and each query's view of them follows the streams' lifetime rules, so a prefill chunk
adds exactly what decode steps at its positions would.
"""

from __future__ import annotations

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import group_keys
from kvtune.kernels.attention.query_groups import query_groups


def window_attention_mass(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    q_seq_starts: torch.Tensor,
    streams: list[PagedStream],
    scale: float,
    decode: bool,
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per sequence of the batch: (mass fp64 [queries, Hkv, L], key positions int64 [L]) of
    its window tokens, or None when it has none.

    q: [Nq, Hq, D] in the cache's space; q_positions: int32 [Nq] absolute positions; streams:
    the window streams (one per block kind, each stride 1); decode: the cache is already in
    the state the queries see (lifetimes ignored, as attention does)."""
    num_seqs = len(q_seq_starts) - 1
    result: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_seqs
    num_heads, head_dim = q.shape[1], q.shape[2]
    for group in query_groups(q_seq_starts):
        parts = []
        for stream in streams:
            gathered = group_keys(stream, group, None if decode else q_positions)
            if gathered is None:
                continue
            length = gathered.keys.shape[1]
            starts = stream.select(group.seqs).start_positions.long()
            positions = starts[:, None] + torch.arange(length, device=starts.device)
            parts.append((gathered, positions))
        if not parts:
            continue
        keys = torch.cat([gathered.keys for gathered, _ in parts], dim=1)
        visible = torch.cat([gathered.visible[:, 0] for gathered, _ in parts], dim=-1)
        positions = torch.cat([p for _, p in parts], dim=1)
        seqs, _, kv_heads, _ = keys.shape
        queries = q[group.rows].float().view(seqs, -1, kv_heads, num_heads // kv_heads, head_dim)
        logits = torch.einsum("schgd,slhd->schgl", queries, keys).double() * scale
        logits = logits.masked_fill(~visible[:, :, None, None, :], -torch.inf)
        mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=3)  # [S, C, Hkv, L]
        for row, seq in enumerate(group.seqs.tolist()):
            seen = visible[row].any(dim=0)
            if seen.any():
                result[seq] = (mass[row][..., seen], positions[row][seen])
    return result
