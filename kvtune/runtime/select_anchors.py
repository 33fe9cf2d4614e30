"""Reusing a CSA selection across positions (policy.csa_select_every = N > 1; LServe's reusable
page selector).

A query at position p is scored by the query at its anchor, p - p % N, over the older blocks
that p itself sees. Anchors depend on absolute positions only, so a prefill chunk scores every
query exactly as the decode step at that position would: teacher-forced accuracy measures what
decode does. A decode step between anchors whose sequences hold the same older blocks as when
they last chose gets the same choice again, so it skips scoring and fetching altogether (on a
GPU also the per-layer host sync that reads a choice).

Each sequence keeps its latest anchor's scoring query per layer (`SequenceKV.anchor_queries`):
[query heads, head_dim], 0.04% of a 4K-token fp16 cache on SmolLM2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.runtime.block_manager import SequenceKV


@dataclass(frozen=True)
class AnchorPlan:
    """Where each query of a step takes its scoring query from, built once a step."""

    # [Nq] rows of cat(q, the stored anchors of `stored`): each query's anchor.
    source_rows: torch.Tensor
    # Sequences whose stored anchor query a query of this step reads (rows Nq, Nq + 1, ...).
    stored: list[SequenceKV]
    # (sequence, row): the last anchor among a sequence's queries of this step, kept for later.
    new_anchors: list[tuple[SequenceKV, int]]
    # A decode step whose every sequence holds the choice it would make again reads
    # `SequenceKV.choices` instead of selecting.
    reselects: bool


def plan_anchors(
    kvs: list[SequenceKV],
    positions: list[list[int]],
    every: int,
    device: torch.device | str,
) -> AnchorPlan:
    """The anchor plan, for the layers whose selection serves `every` positions, of a step whose
    sequences kvs place queries at `positions` (consecutive within a sequence). Records on each
    sequence what a decode step's choice there is made for (its anchor and older blocks), or
    that a prefill step leaves nothing staged to reuse."""
    total = sum(len(seq_positions) for seq_positions in positions)
    rows: list[int] = []
    stored: list[SequenceKV] = []
    new_anchors: list[tuple[SequenceKV, int]] = []
    first_row = 0
    for kv, seq_positions in zip(kvs, positions, strict=True):
        start = seq_positions[0]
        stored_row = None
        for position in seq_positions:
            anchor = position - position % every
            if anchor >= start:
                rows.append(first_row + anchor - start)
                continue
            if stored_row is None:
                stored_row = total + len(stored)
                stored.append(kv)
            rows.append(stored_row)
        last_anchor = seq_positions[-1] - seq_positions[-1] % every
        if last_anchor >= start:
            new_anchors.append((kv, first_row + last_anchor - start))
        first_row += len(seq_positions)
    decode = all(len(seq_positions) == 1 for seq_positions in positions)
    reselects = not decode
    for kv, seq_positions in zip(kvs, positions, strict=True):
        made_for = None
        if decode:
            made_for = (seq_positions[0] - seq_positions[0] % every, len(kv.host_blocks))
            reselects = reselects or kv.selected_for.get(every) != made_for
        kv.selected_for[every] = made_for
    return AnchorPlan(
        torch.tensor(rows, dtype=torch.int64, device=device), stored, new_anchors, reselects
    )


def scoring_queries(plan: AnchorPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
    """[Nq, Hq, D]: each query's anchor query in `layer`; keeps this step's new anchors."""
    sources = q
    if plan.stored:
        kept = torch.stack([kv.anchor_queries[layer] for kv in plan.stored])
        sources = torch.cat([q, kept])
    scored = sources.index_select(0, plan.source_rows)
    for kv, row in plan.new_anchors:
        kv.anchor_queries[layer] = scored[row].clone()
    return scored
