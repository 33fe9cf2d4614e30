"""Packed queries grouped by sequence length in queries: the unit the torch attention paths
batch (`kvtune.kernels.attention.paged_torch`, `kvtune.kernels.attention.decode_torch`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.kernels.attention.identity_memo import IdentityMemo


@dataclass(frozen=True)
class QueryGroup:
    """Sequences with the same number of queries, attended in one batched call: a decode step's
    sequences share one group and each prefill chunk length another, so no sequence pays for a
    longer one's queries (padding every sequence to the longest chunk made a mixed step cost
    batch x chunk x context)."""

    seqs: torch.Tensor  # [S] the group's sequences (indices into the batch)
    rows: torch.Tensor  # [S, C] packed query row of each (sequence, query)


def query_groups(q_seq_starts: torch.Tensor) -> list[QueryGroup]:
    """Sequences grouped by their number of queries, in increasing count (grouped on the host:
    a handful of sequences, where tensor ops cost more than the loop). Every layer of a step
    passes the same q_seq_starts: grouped once (`_GROUPS`)."""
    groups = _GROUPS.get((q_seq_starts,))
    if groups is None:
        groups = _GROUPS.put((q_seq_starts,), _grouped(q_seq_starts))
    return groups


_GROUPS = IdentityMemo(4)


def _grouped(q_seq_starts: torch.Tensor) -> list[QueryGroup]:
    starts = q_seq_starts.long()
    by_count: dict[int, list[int]] = {}
    for seq, count in enumerate((starts[1:] - starts[:-1]).tolist()):
        if count:
            by_count.setdefault(count, []).append(seq)
    groups = []
    for count, members in sorted(by_count.items()):
        seqs = torch.tensor(members, device=starts.device)
        offsets = torch.arange(count, device=starts.device)
        groups.append(QueryGroup(seqs, starts[seqs][:, None] + offsets[None, :]))
    return groups
