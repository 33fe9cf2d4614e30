"""Importance-kept CSA blocks (policy.csa_keep): which older blocks stay exact on the device.

Every older block is pooled into summaries as before. Its group of KEEP_GROUP consecutive
blocks is decided when the group's first block leaves the window: in each layer, each KV head
copies into the group's kept blocks (SequenceKV.keep_blocks, allocated by the block manager)
the csa_keep * KEEP_GROUP candidates with the most attention received per query so far
(kernels/window_mass.py; a later block of the group has been in the window for fewer queries).
A kept copy is shown, and its summaries hidden, from the position its block leaves the window.

Only queries before a group's decision count, in prefill as in decode: keeping is causal. What
the cache holds once a prompt's first n tokens are processed (kept blocks and the importance
of undecided groups) depends on those tokens alone, so a document cached for reuse serves any
question that follows, and the groups decided within the document keep the same blocks
whatever follows. A group whose first block is still in the window when the document ends is
decided later, with the attention of the tokens after it: the question's in prefill, as decode
steps' queries decide the groups of a generation (SnapKV chooses by the question's attention).
"""

from __future__ import annotations

import dataclasses

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import KVPool, copy_blocks
from kvtune.kernels.selection.window_mass import window_attention_mass
from kvtune.runtime.block_manager import KeepGroup, SequenceKV
from kvtune.runtime.policy import KEEP_GROUP, KVPolicy


class KeptBlocks:
    """The policy's keep rule: importance bookkeeping, decisions and the attention masks."""

    def __init__(self, policy: KVPolicy, num_kv_heads: int, device: torch.device) -> None:
        self.policy = policy
        self.heads = num_kv_heads
        self.device = device

    def exit_position(self, older: torch.Tensor) -> torch.Tensor:
        """First query position that no longer sees older block `older` in the window (the
        streams' lifetime rule: block end + csa_window)."""
        p = self.policy
        return p.csa_sinks + (older + 1) * p.block_size + p.csa_window

    def _decision_position(self, older: torch.Tensor) -> torch.Tensor:
        """Position at which the group of older block `older` is decided."""
        return self.exit_position(older - older % KEEP_GROUP)

    def observe(
        self,
        layer: int,
        kvs: list[SequenceKV],
        q: torch.Tensor,
        q_positions: torch.Tensor,
        q_seq_starts: torch.Tensor,
        window: list[PagedStream],
        scale: float,
        decode: bool,
    ) -> None:
        """Add the window attention of this step's queries to each undecided block's
        importance (a query counts only for groups decided after it)."""
        masses = window_attention_mass(q, q_positions, q_seq_starts, window, scale, decode)
        p = self.policy
        starts = q_seq_starts.tolist()
        for index, (kv, found) in enumerate(zip(kvs, masses, strict=True)):
            if found is None:
                continue
            mass, key_positions = found
            older = (key_positions - p.csa_sinks) // p.block_size
            queries = q_positions[starts[index] : starts[index + 1]].long()
            counts = queries[:, None] < self._decision_position(older)[None, :]
            received = (mass * counts[:, None, :]).sum(dim=0)  # [Hkv, L]
            total = kv.importance.get(layer)
            size = int(older.max()) + 1
            if total is None or total.shape[1] < size:
                grown = torch.zeros(self.heads, max(size, 64), dtype=torch.float64)
                if total is not None:
                    grown[:, : total.shape[1]] = total
                total = kv.importance[layer] = grown.to(self.device)
            total.index_add_(1, older, received)

    def decide(self, layer: int, kvs: list[SequenceKV], k: KVPool, v: KVPool) -> None:
        """Fill the kept blocks of every group decided in this maintenance, in one layer."""
        for kv in kvs:
            for group in kv.pending_keeps:
                self._decide_group(layer, kv, group, k, v)

    def _decide_group(
        self, layer: int, kv: SequenceKV, group: KeepGroup, k: KVPool, v: KVPool
    ) -> None:
        p = self.policy
        older = torch.arange(group.first, group.first + KEEP_GROUP, device=self.device)
        importance = kv.importance.get(layer)
        received = torch.zeros(self.heads, KEEP_GROUP, dtype=torch.float64, device=self.device)
        if importance is not None:
            known = importance[:, group.first : group.first + KEEP_GROUP]
            received[:, : known.shape[1]] = known
        block_starts = p.csa_sinks + older * p.block_size
        queries_seen = self._decision_position(older) - block_starts
        per_query = received / queries_seen[None, :]
        best = per_query.topk(p.kept_per_group, dim=1, sorted=False).indices.sort(dim=1).values
        kept = kv.kept.setdefault(
            layer,
            torch.full((0, self.heads), -1, dtype=torch.long, device=self.device),
        )
        if kept.shape[0] < len(kv.keep_blocks):
            grown = torch.full(
                (len(kv.keep_blocks), self.heads), -1, dtype=torch.long, device=self.device
            )
            grown[: kept.shape[0]] = kept
            kept = kv.kept[layer] = grown
        candidates = torch.tensor(group.candidates, dtype=torch.long)
        heads = torch.arange(self.heads).repeat(p.kept_per_group)
        chosen = best.T.flatten().cpu()  # slot-major: slot i's heads, then slot i + 1's
        slots = torch.arange(group.slots, group.slots + p.kept_per_group)
        targets = torch.tensor(kv.keep_blocks)[slots].repeat_interleave(self.heads)
        for pool in (k, v):
            copy_blocks(pool, candidates[chosen], pool, targets, heads)
        kept[group.slots : group.slots + p.kept_per_group] = (group.first + best).T

    def apply(
        self,
        layer: int,
        kvs: list[SequenceKV],
        q_positions: torch.Tensor,
        q_seq_starts: torch.Tensor,
        summaries: PagedStream | None,
        k: KVPool,
        v: KVPool,
    ) -> dict[str, PagedStream]:
        """The kept stream of this step (shown per query and KV head once its block left the
        window) and the summary stream with the kept blocks' summaries hidden."""
        if summaries is None or not any(kv.keep_blocks for kv in kvs):
            return {}
        p = self.policy
        per_block = p.block_size // p.csa_ratio
        rows = []
        summary_rows = []
        counts = (q_seq_starts[1:] - q_seq_starts[:-1]).tolist()
        width = max(1, max(len(kv.keep_blocks) for kv in kvs)) * p.block_size
        summary_width = summaries.block_table.shape[1] * summaries.block_size
        positions = q_positions.long().split(counts)
        for kv, queries in zip(kvs, positions, strict=True):
            kept = kv.kept.get(layer)
            shown = torch.zeros(len(queries), self.heads, width, dtype=torch.bool)
            hidden = torch.zeros(self.heads, summary_width, dtype=torch.bool)
            shown, hidden = shown.to(self.device), hidden.to(self.device)
            if kept is not None and len(kept):
                if bool((kept < 0).any()):
                    raise RuntimeError(f"layer {layer}: a kept block was allocated, not decided")
                exits = self.exit_position(kept).T  # [Hkv, slots]
                visible = queries[:, None, None] >= exits[None]
                shown[..., : kept.shape[0] * p.block_size] = visible.repeat_interleave(
                    p.block_size, dim=2
                )
                vectors = (kept.T[..., None] * per_block + torch.arange(per_block)).flatten(1)
                hidden.scatter_(1, vectors.clamp(max=summary_width - 1), True)
            rows.append(shown)
            summary_rows.append(hidden[None].expand(len(queries), -1, -1))
        table = torch.zeros(len(kvs), width // p.block_size, dtype=torch.int32)
        for row, kv in enumerate(kvs):
            table[row, : len(kv.keep_blocks)] = torch.tensor(kv.keep_blocks, dtype=torch.int32)
        kept_stream = PagedStream(
            k,
            v,
            table.to(self.device),
            torch.tensor(
                [len(kv.keep_blocks) * p.block_size for kv in kvs],
                dtype=torch.int32,
                device=self.device,
            ),
            torch.full((len(kvs),), p.csa_sinks, dtype=torch.int32, device=self.device),
            query_mask=torch.cat(rows).contiguous(),
        )
        mask = ~torch.cat(summary_rows)
        if summaries.query_mask is not None:
            mask = mask & summaries.query_mask
        return {
            "kept": kept_stream,
            "summary": dataclasses.replace(summaries, query_mask=mask.contiguous()),
        }
