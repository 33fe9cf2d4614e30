"""A step's maintenance copies (demotions, pooling into summaries, host-tier and index copies),
grouped once for the batch and run on each layer's pools."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kvtune.kernels.cache.compress import compress_blocks_ref
from kvtune.kernels.cache.pool import copy_blocks
from kvtune.kernels.formats.rotation import Rotation
from kvtune.kernels.selection.blocks import write_key_bounds, write_key_means
from kvtune.runtime.backends import CacheOps
from kvtune.runtime.block_manager import BlockCopy
from kvtune.runtime.cache_pools import LayerPools
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX


@dataclass(frozen=True)
class CopyGroup:
    """Copies of one source kind, ratio and destination kind, as index tensors built once for
    every layer."""

    src_kind: str
    ratio: int
    dst_kind: str
    op: str
    src_blocks: torch.Tensor
    dst_slots: torch.Tensor


def copy_groups(copies: list[BlockCopy], device: torch.device) -> list[CopyGroup]:
    """Copies grouped by (source kind, ratio, destination kind), in first-seen order: a block
    demoted and pooled in one maintenance is pooled from its demoted codes."""
    groups: dict[tuple[str, int, str, str], list[BlockCopy]] = defaultdict(list)
    for copy in copies:
        groups[(copy.src_kind, copy.ratio, copy.dst_kind, copy.op)].append(copy)
    return [
        CopyGroup(
            src_kind,
            ratio,
            dst_kind,
            op,
            torch.tensor([c.src_block for c in group], dtype=torch.int32, device=device),
            torch.tensor([s for c in group for s in c.dst_slots], dtype=torch.int64, device=device),
        )
        for (src_kind, ratio, dst_kind, op), group in groups.items()
    ]


def run_copies(
    pools: LayerPools,
    groups: list[CopyGroup],
    policy: KVPolicy,
    ops: CacheOps,
    rotation: Rotation | None,
    alignment: torch.Tensor | None,
) -> None:
    """Run the copies on one layer's pools. rotation: the layer's keys' (a separate index keeps
    its bounds or means in the model's basis); alignment: its pre-RoPE pooling turns (None: keys
    pooled as cached)."""
    bs = policy.block_size
    for group in groups:
        if group.dst_kind not in pools.k:  # the host tier or index of a layer without them
            continue
        index_rotation = rotation if policy.separate_index else None
        if group.op == "bounds":
            write_key_bounds(
                pools.k[group.src_kind],
                group.src_blocks,
                pools.k[INDEX],
                pools.v[INDEX],
                group.dst_slots,
                index_rotation,
            )
            continue
        if group.op == "means":
            keys = pools.k[group.src_kind]
            write_key_means(keys, group.src_blocks, pools.k[INDEX], group.dst_slots, index_rotation)
            continue
        for by_kind, align in ((pools.k, alignment), (pools.v, None)):
            source, target = by_kind[group.src_kind], by_kind[group.dst_kind]
            if group.dst_kind == HOST and source.fmt == target.fmt:
                copy_blocks(source, group.src_blocks, target, group.dst_slots[::bs] // bs)
                continue
            if group.dst_kind == HOST:  # from an fp16 recent block: quantized once, by torch
                compress_blocks_ref(source, group.src_blocks, target, group.dst_slots, 1)
                continue
            ops.compress_blocks(
                source,
                group.src_blocks,
                target,
                group.dst_slots,
                group.ratio,
                align if group.ratio > 1 else None,
            )
