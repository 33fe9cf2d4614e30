"""The host tier's blocks brought to the device for selection, and the bytes that moves.

A decode step fetches the blocks each KV head selected into the sequence's staging blocks,
reusing those still there; a streamed staging pool (policy.streams_staging) is one tensor per
distinct layer format that every layer of that format fills in turn, so each step refetches
every layer's choice into it. A prefill step reads the host tier in place, or, where the tier
lives off the device (pinned host memory beside a GPU), from a scratch copy of the blocks its
sequences hold (kvtune/runtime/pool_plan.py counts that scratch).
"""

from __future__ import annotations

import dataclasses
from array import array
from itertools import compress

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import KVPool, copy_blocks
from kvtune.runtime.block_manager import SequenceKV
from kvtune.runtime.cache_pools import LayerPools
from kvtune.runtime.pool_kinds import HOST, STAGE


class HostFetch:
    """Fetches for every layer. staging_kind: the pool of the staging blocks (MAIN resident,
    STAGE streamed); layer_topk: each layer's budget; layer_bytes: one block of each layer
    (K and V, every KV head). fetched_bytes counts what moved to the device."""

    def __init__(
        self,
        layers: list[LayerPools],
        staging_kind: str,
        layer_topk: list[int],
        layer_bytes: list[int],
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.staging_kind = staging_kind
        self.layer_topk = layer_topk
        self.layer_bytes = layer_bytes
        self.device = device
        self.fetched_bytes = 0

    def restage(self, layer: int, kvs: list[SequenceKV]) -> list[list[int]]:
        """The staging blocks of each sequence's last choice in `layer`, made again: a
        resident pool still holds it; a streamed one holds the previous layer's blocks and
        fetches it again."""
        if self.staging_kind == STAGE:
            return self.fetch(layer, kvs, [kv.choices[layer] for kv in kvs])
        return [kv.staging_blocks[: self.layer_topk[layer]] for kv in kvs]

    def host_is_remote(self, host: PagedStream) -> bool:
        """Whether the host tier lives off the device (pinned host memory beside a GPU), where
        the kernels cannot read it in place."""
        return host.k.codes.device != self.device

    def fetch_for_prefill(self, layer: int, host: PagedStream) -> PagedStream:
        """The host blocks a prefill step's sequences hold, copied into a scratch device pool
        for the step (a prefill reads most of them; decode fetches only what it chose)."""
        counts = [-(-int(n) // host.block_size) for n in host.lengths.tolist()]
        table = host.block_table.to(host.k.codes.device).long()
        used = torch.cat([row[:count] for row, count in zip(table, counts, strict=True)])
        scratch = [
            KVPool(
                pool.codes[used].to(self.device),
                None if pool.scales is None else pool.scales[used].to(self.device),
                pool.fmt,
                pool.tensor_scale.to(self.device),
            )
            for pool in (host.k, host.v)
        ]
        self.fetched_bytes += len(used) * self.layer_bytes[layer]
        renumbered = torch.zeros_like(host.block_table)
        first = 0
        for row, count in enumerate(counts):
            renumbered[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
            first += count
        return dataclasses.replace(
            host, k=scratch[0], v=scratch[1], block_table=renumbered.to(self.device)
        )

    def fetch(
        self, layer: int, kvs: list[SequenceKV], choices: list[list[list[bool]]]
    ) -> list[list[int]]:
        """The staging blocks of each sequence in one layer, each KV head's slice of them
        holding a block that head chose: slices not staged yet are fetched from the host tier
        into slices whose block that head no longer chose, for all sequences in one copy per
        tensor (a copy per sequence made a batch's fetch cost calls, not bytes). A decode query
        sees every older block, so each head chose min(the layer's budget, blocks): exactly
        the first staging blocks (all of them where the budget is csa_topk)."""
        kind = self.staging_kind
        reads, writes, slices, staged_blocks = [], [], [], []
        for kv, chosen in zip(kvs, choices, strict=True):
            heads = len(chosen)
            slots = kv.staging_blocks[: self.layer_topk[layer]]
            staged_blocks.append(slots)
            # A streamed pool holds the previous layer's blocks: everything is fetched again.
            staged = (
                [{} for _ in range(heads)]
                if kind == STAGE
                else kv.staged.setdefault(layer, [{} for _ in range(heads)])
            )
            for head, picks in enumerate(chosen):
                # Set operations and compress run in C: a decode step does this for every
                # layer and KV head over all older blocks.
                wanted = set(compress(kv.host_blocks, picks))
                holds = staged[head]  # staging block -> host block whose slice it holds
                missing = sorted(wanted.difference(holds.values()))
                free = (b for b in slots if holds.get(b) not in wanted)  # taken while missing lasts
                for host, staging in zip(missing, free, strict=False):
                    holds[staging] = host
                    reads.append(host)
                    writes.append(staging)
                    slices.append(head)
        if reads:
            pools = self.layers[layer]
            # One tensor of 3 rows, straight from an int64 buffer (a tensor built from lists
            # of ints cost a quarter of a fetch).
            index = torch.frombuffer(array("q", reads + writes + slices), dtype=torch.int64)
            index = index.view(3, -1)
            for by_kind in (pools.k, pools.v):
                copy_blocks(by_kind[HOST], index[0], by_kind[kind], index[1], index[2])
            self.fetched_bytes += len(reads) * self.layer_bytes[layer] // pools.k[HOST].num_heads
        return staged_blocks
