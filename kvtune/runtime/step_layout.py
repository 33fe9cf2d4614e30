"""A step's layout, built once and read by every layer: where its new tokens go, the copies
that bring the cache to what its last query sees, and the streams its queries read.

A sequence's cache is up to five exact and pooled streams (sinks and window, each split into
main and recent blocks, plus summaries), and with selection its host-tier and index streams.
A prefill chunk must score every position on the cache a decode step there would read. The
engine brings the layout to the chunk's last position before the attention; the blocks demoted
or pooled on the way are still readable (`SequenceKV.retiring`), and each stream carries a
lifetime rule (PagedStream.shown_from / hidden_from) that shows a block's exact, recent or
pooled form to exactly the positions that decode would show it to.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from kvtune.runtime.block_copies import CopyGroup, copy_groups
from kvtune.runtime.block_manager import Block, BlockCopy, SequenceKV
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, RECENT
from kvtune.runtime.select_anchors import AnchorPlan, plan_anchors


@dataclass(frozen=True)
class StreamSpec:
    """One stream of this step's batch: same for every layer, only the pools differ."""

    name: str
    kind: str
    block_table: torch.Tensor
    lengths: torch.Tensor
    start_positions: torch.Tensor
    position_stride: int = 1
    logit_bias: float = 0.0
    shown_from: int | None = None
    hidden_from: int | None = None


@dataclass(frozen=True)
class StepLayout:
    """Where this step's new tokens go, the copies that bring the cache to what its last query
    sees (run per layer after the write), and which streams its queries read."""

    slot_mapping: torch.Tensor
    q_positions: torch.Tensor
    q_seq_starts: torch.Tensor
    max_q_len: int
    streams: list[StreamSpec]
    copies: list[CopyGroup]
    kvs: list[SequenceKV]
    # Where selection takes each query's scoring query, by N (the layers' csa_select_every
    # values above 1; a layer with N = 1 scores each query by itself).
    anchors: dict[int, AnchorPlan] = dataclasses.field(default_factory=dict)

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1


def int32_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def block_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """int32 [rows, longest row] of block ids, short rows padded with 0."""
    if len({len(r) for r in rows}) == 1 and rows[0]:  # one tensor at once (a decode step)
        return torch.tensor(rows, dtype=torch.int32, device=device)
    width = max(1, max(len(r) for r in rows))
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, ids in enumerate(rows):
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return table.to(device)


class StepLayouts:
    """Builds each step's layout for one policy on one device; reuse_periods: the layers'
    csa_select_every values above 1 (one anchor plan each a step)."""

    def __init__(self, policy: KVPolicy, device: torch.device, reuse_periods: list[int]) -> None:
        self.policy = policy
        self.device = device
        self.reuse_periods = reuse_periods

    def _int32(self, values: list[int]) -> torch.Tensor:
        return int32_tensor(values, self.device)

    def build(
        self,
        kvs: list[SequenceKV],
        slots: list[list[int]],
        positions: list[list[int]],
        copies: list[BlockCopy],
    ) -> StepLayout:
        """This step's layout, built once and reused by every layer.

        kvs, slots, positions: per scheduled sequence, its blocks (after this step's append and
        the maintenance up to its last position), the slots of its new tokens and their
        absolute positions; copies: what that maintenance asked for.
        """
        starts = [0]
        for seq_positions in positions:
            starts.append(starts[-1] + len(seq_positions))
        flat_slots = [slot for seq_slots in slots for slot in seq_slots]
        return StepLayout(
            slot_mapping=torch.tensor(flat_slots, dtype=torch.int64, device=self.device),
            q_positions=self._int32([p for seq_positions in positions for p in seq_positions]),
            q_seq_starts=self._int32(starts),
            max_q_len=max(len(p) for p in positions),
            streams=self._stream_specs(kvs),
            copies=copy_groups(copies, self.device),
            kvs=kvs,
            anchors={
                every: plan_anchors(kvs, positions, every, self.device)
                for every in self.reuse_periods
            },
        )

    def _lifetime(self, name: str, kind: str) -> tuple[int | None, int | None]:
        """(shown_from, hidden_from) of a stream's blocks, from the policy's thresholds: a block
        is demoted once recent_unquantized tokens follow its end, and a window block is pooled
        once csa_window tokens do (straight from its recent copy if that comes first)."""
        recent, window = self.policy.recent_unquantized, self.policy.csa_window
        pooled = window if self.policy.compressed and name == "window" else None
        if name in ("summary", "host", "index"):
            return window, None
        if kind == RECENT:
            return None, min(recent, pooled) if pooled is not None else recent
        return (recent if self.policy.recent_tail else None), pooled

    def _stream_specs(self, kvs: list[SequenceKV]) -> list[StreamSpec]:
        """One spec per (stream, block kind) that holds any vector in this batch."""
        ratio, bs = self.policy.csa_ratio, self.policy.block_size
        rows: dict[tuple[str, str], list[tuple[list[int], int, int]]] = defaultdict(list)
        for kv in kvs:
            for name, parts in _exact_segments(kv, self.policy.block_size).items():
                for kind in (MAIN, RECENT):
                    rows[(name, kind)].append(parts.get(kind, ([], 0, 0)))
            summaries = (kv.summary_blocks, kv.num_summaries, self.policy.csa_sinks)
            rows[("summary", MAIN)].append(summaries)
            if self.policy.selects:
                host = (kv.host_blocks, len(kv.host_blocks) * bs, self.policy.csa_sinks)
                rows[("host", HOST)].append(host)
            if self.policy.pooled_index:
                index = (kv.index_blocks, len(kv.host_blocks), self.policy.csa_sinks)
                rows[("index", INDEX)].append(index)
        specs = []
        for (name, kind), per_seq in rows.items():
            if not any(length for _, length, _ in per_seq):
                continue
            summary = name == "summary"
            stride = {"summary": ratio, "index": bs}.get(name, 1)
            shown_from, hidden_from = self._lifetime(name, kind)
            specs.append(
                StreamSpec(
                    name=name,
                    kind=kind,
                    block_table=block_table([ids for ids, _, _ in per_seq], self.device),
                    lengths=self._int32([length for _, length, _ in per_seq]),
                    start_positions=self._int32([start for _, _, start in per_seq]),
                    position_stride=stride,
                    logit_bias=math.log(ratio) if summary else 0.0,
                    shown_from=shown_from,
                    hidden_from=hidden_from,
                )
            )
        return specs


def _exact_segments(
    kv: SequenceKV, block_size: int
) -> dict[str, dict[str, tuple[list[int], int, int]]]:
    """Per exact stream ("sinks", "window") and block kind: (block ids, length, start position)
    of its consecutive blocks, retiring ones included. A block and its demoted copy cover the
    same positions in different kinds, so each kind's blocks are consecutive."""
    segments: dict[str, dict[str, tuple[list[int], int, int]]] = {}
    for name, stream in (("sinks", kv.sinks), ("window", kv.window)):
        blocks: list[tuple[int, Block]] = [
            (stream.start + index * block_size, block) for index, block in enumerate(stream.blocks)
        ]
        blocks += [(r.first_position, r.block) for r in kv.retiring if r.stream == name]
        end = stream.start + stream.length
        by_kind: dict[str, tuple[list[int], int, int]] = {}
        for kind in (MAIN, RECENT):
            mine = sorted((first, block.block_id) for first, block in blocks if block.kind == kind)
            if not mine:
                continue
            start = mine[0][0]
            if [first for first, _ in mine] != list(
                range(start, start + len(mine) * block_size, block_size)
            ):
                raise RuntimeError(f"{name} {kind} blocks are not consecutive: {mine}")
            last_end = min(mine[-1][0] + block_size, end)
            by_kind[kind] = ([block_id for _, block_id in mine], last_end - start, start)
        segments[name] = by_kind
    return segments
