"""The paged KV cache of every layer, and attention over it for one engine step.

Per layer: a main pool in the layer's K and V formats (quantized tokens and CSA summaries) and,
when recent_unquantized > 0, an fp16 pool for the most recent tokens. A sequence's cache is up
to five streams (sinks and window, each split into main and recent blocks, plus summaries);
attention is one softmax over all of them (DESIGN.md section 3): the Triton backend attends each
stream and merges the partial results by log-sum-exp, the torch backend concatenates them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from kernels.attention import PagedStream
from kernels.pool import KVPool
from runtime.arch import ModelArch
from runtime.backends import CacheOps
from runtime.block_manager import MAIN, RECENT, BlockCopy, BlockManager, ExactStream, SequenceKV
from runtime.kv_bytes import layer_formats, token_bytes
from runtime.policy import KVPolicy


@dataclass(frozen=True)
class LayerPools:
    """K and V pools of one layer, by block kind (MAIN, and RECENT when used)."""

    k: dict[str, KVPool]
    v: dict[str, KVPool]


@dataclass(frozen=True)
class StreamSpec:
    """One stream of this step's batch: same for every layer, only the pools differ."""

    kind: str
    block_table: torch.Tensor
    lengths: torch.Tensor
    start_positions: torch.Tensor
    position_stride: int = 1
    logit_bias: float = 0.0


@dataclass(frozen=True)
class StepLayout:
    """Where this step's new tokens go and which streams its queries read."""

    slot_mapping: torch.Tensor
    q_positions: torch.Tensor
    q_seq_starts: torch.Tensor
    max_q_len: int
    streams: list[StreamSpec]

    @property
    def decode_only(self) -> bool:
        return self.max_q_len == 1


def block_bytes(arch: ModelArch, policy: KVPolicy) -> dict[str, int]:
    """Bytes one block id costs across all layers, for each block kind."""
    formats = layer_formats(arch, policy)
    return {
        MAIN: policy.block_size * sum(token_bytes(arch, f.k, f.v) for f in formats),
        RECENT: policy.block_size * sum(token_bytes(arch, f.k_recent, f.v_recent) for f in formats),
    }


class KVCache:
    """Pools of all layers plus the per-step attention that reads and writes them."""

    def __init__(
        self,
        arch: ModelArch,
        policy: KVPolicy,
        blocks: BlockManager,
        ops: CacheOps,
        tensor_scales: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
    ) -> None:
        self.policy = policy
        self.blocks = blocks
        self.ops = ops
        self.device = device
        self.layers: list[LayerPools] = []
        bs, heads, size = policy.block_size, arch.cached_heads, arch.cached_vector_size
        counts = {kind: pool.num_blocks for kind, pool in blocks.pools.items()}
        for formats, (k_scale, v_scale) in zip(
            layer_formats(arch, policy), tensor_scales, strict=True
        ):
            k_pools = {
                MAIN: KVPool.allocate(formats.k, counts[MAIN], bs, heads, size, k_scale, device)
            }
            v_pools = {
                MAIN: KVPool.allocate(formats.v, counts[MAIN], bs, heads, size, v_scale, device)
            }
            if counts[RECENT]:
                k_pools[RECENT] = KVPool.allocate(
                    formats.k_recent, counts[RECENT], bs, heads, size, None, device
                )
                v_pools[RECENT] = KVPool.allocate(
                    formats.v_recent, counts[RECENT], bs, heads, size, None, device
                )
            self.layers.append(LayerPools(k_pools, v_pools))

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every pool tensor of every layer (codes and scales)."""
        total = 0
        for layer in self.layers:
            for pool in [*layer.k.values(), *layer.v.values()]:
                total += pool.codes.numel() * pool.codes.element_size()
                if pool.scales is not None:
                    total += pool.scales.numel() * pool.scales.element_size()
        return total

    def _int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def layout(
        self, kvs: list[SequenceKV], slots: list[list[int]], positions: list[list[int]]
    ) -> StepLayout:
        """This step's layout, built once and reused by every layer.

        kvs, slots, positions: per scheduled sequence, its blocks (after this step's append),
        the slots of its new tokens and their absolute positions.
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
        )

    def _stream_specs(self, kvs: list[SequenceKV]) -> list[StreamSpec]:
        """One spec per (stream, block kind) that holds any vector in this batch."""
        bs, ratio = self.policy.block_size, self.policy.csa_ratio
        rows: dict[tuple[str, str], list[tuple[list[int], int, int]]] = defaultdict(list)
        for kv in kvs:
            for name, stream in (("sinks", kv.sinks), ("window", kv.window)):
                parts = _split_by_kind(stream, bs)
                for kind in (MAIN, RECENT):
                    rows[(name, kind)].append(parts.get(kind, ([], 0, stream.start)))
            summaries = (kv.summary_blocks, kv.num_summaries, self.policy.csa_sinks)
            rows[("summary", MAIN)].append(summaries)
        specs = []
        for (name, kind), per_seq in rows.items():
            if not any(length for _, length, _ in per_seq):
                continue
            summary = name == "summary"
            specs.append(
                StreamSpec(
                    kind=kind,
                    block_table=self._block_table([ids for ids, _, _ in per_seq]),
                    lengths=self._int32([length for _, length, _ in per_seq]),
                    start_positions=self._int32([start for _, _, start in per_seq]),
                    position_stride=ratio if summary else 1,
                    logit_bias=math.log(ratio) if summary else 0.0,
                )
            )
        return specs

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, ids in enumerate(rows):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table.to(self.device)

    def attend(
        self,
        layer: int,
        layout: StepLayout,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V of one layer, then attend its queries over the cache."""
        pools = self.layers[layer]
        tail = self.blocks.tail_kind
        self.ops.write_kv(k, v, layout.slot_mapping, pools.k[tail], pools.v[tail])
        streams = [
            PagedStream(
                pools.k[spec.kind],
                pools.v[spec.kind],
                spec.block_table,
                spec.lengths,
                spec.start_positions,
                spec.position_stride,
                spec.logit_bias,
            )
            for spec in layout.streams
        ]
        positions = None if layout.decode_only else layout.q_positions
        out = self.ops.attention(
            q, positions, layout.q_seq_starts, streams, scale, layout.max_q_len
        )
        return out.to(q.dtype)

    def apply_copies(self, copies: list[BlockCopy]) -> None:
        """Execute compressions and recent->main moves on every layer (sources freed by caller)."""
        groups: dict[tuple[str, int], list[BlockCopy]] = defaultdict(list)
        for copy in copies:
            groups[(copy.src_kind, copy.ratio)].append(copy)
        for (src_kind, ratio), group in groups.items():
            src_ids = torch.tensor(
                [c.src_block for c in group], dtype=torch.int32, device=self.device
            )
            dst_slots = torch.tensor(
                [s for c in group for s in c.dst_slots], dtype=torch.int64, device=self.device
            )
            for pools in self.layers:
                for by_kind in (pools.k, pools.v):
                    self.ops.compress_blocks(
                        by_kind[src_kind], src_ids, by_kind[MAIN], dst_slots, ratio
                    )


def _split_by_kind(stream: ExactStream, block_size: int) -> dict[str, tuple[list[int], int, int]]:
    """(block ids, length, start position) of a stream's main prefix and recent suffix."""
    main_ids = [b.block_id for b in stream.blocks if b.kind == MAIN]
    recent_ids = [b.block_id for b in stream.blocks if b.kind == RECENT]
    parts = {}
    main_length = min(stream.length, len(main_ids) * block_size)
    if main_ids:
        parts[MAIN] = (main_ids, main_length, stream.start)
    if recent_ids:
        parts[RECENT] = (recent_ids, stream.length - main_length, stream.start + main_length)
    return parts
