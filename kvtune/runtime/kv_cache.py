"""The paged KV cache of every layer, and attention over it for one engine step.

Per layer: a main pool in the layer's K and V formats (quantized tokens and CSA summaries) and,
when recent_unquantized > 0 or keys are scaled per channel, an fp16 pool for the most recent
tokens (for per-channel keys at least the partial last block, quantized once full). A sequence's
cache is up to five streams (sinks and window, each split into main and recent blocks, plus
summaries); attention is one softmax over all of them (DESIGN.md section 3): the Triton backend
attends each stream and merges the partial results by log-sum-exp, the torch backend
concatenates them.

A prefill chunk must score every position on the cache a decode step there would read. The
engine brings the layout to the chunk's last position before the attention; the blocks demoted
or pooled on the way are still readable (`SequenceKV.retiring`), and each stream carries a
lifetime rule (PagedStream.shown_from / hidden_from) that shows a block's exact, recent or
pooled form to exactly the positions that decode would show it to.

CSA selection (policy.selects): each older block keeps its exact copy in a host tier, and in
every layer each query reads exactly the csa_topk blocks it selects by their key bounds, mean
keys or summaries (kernels/selection.py), the summaries of the others (none without
summaries). Bounds and means live in a per-layer index pool (means in its K half only): in the
layer's formats and rotated space, or (a separate csa_index_dtype) in the model's basis,
scored with the unrotated queries. A
prefill chunk reads the selected blocks where they are (each query its own choice, by mask); a
decode step fetches them into the sequence's staging blocks, reusing those still there, and
counts the bytes it moved. A streamed staging pool (policy.streams_staging) is one tensor per
distinct layer format that every layer of that format fills in turn: each step refetches every
layer's choice into it. With csa_select_every > 1 a query is scored by its anchor's query
(`select_anchors`), and a decode step whose choice would not change reuses the staged one.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.compress import compress_blocks_ref
from kvtune.kernels.cache.pool import KVPool, copy_blocks
from kvtune.kernels.cache.rope_align import summary_alignment
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import (
    Rotation,
    rotate,
    rotate_queries,
    rotation_matrix,
    unrotate,
)
from kvtune.kernels.selection.blocks import select_blocks, write_key_bounds, write_key_means
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.backends import CacheOps
from kvtune.runtime.block_manager import Block, BlockCopy, BlockManager, SequenceKV
from kvtune.runtime.clip_counter import ClipCounter, range_limit
from kvtune.runtime.kept_blocks import KeptBlocks
from kvtune.runtime.kv_bytes import layer_block_bytes, layer_formats
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, RECENT, STAGE
from kvtune.runtime.select_anchors import AnchorPlan, plan_anchors, scoring_queries


@dataclass(frozen=True)
class LayerPools:
    """K and V pools of one layer, by block kind (MAIN, and RECENT, HOST, INDEX, STAGE when
    used; a STAGE pool views codes shared by the layers of one format)."""

    k: dict[str, KVPool]
    v: dict[str, KVPool]


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
class CopyGroup:
    """Copies of one source kind, ratio and destination kind, as index tensors built once for
    every layer."""

    src_kind: str
    ratio: int
    dst_kind: str
    op: str
    src_blocks: torch.Tensor
    dst_slots: torch.Tensor


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


def layer_rotations(
    arch: ModelArch, policy: KVPolicy, device: torch.device | str
) -> list[Rotation | None]:
    """Per layer, the rotation its K and V are cached in (policy.rotation), or None:
    layers with a quantized stream are rotated, all their pools alike."""
    return [
        rotation_matrix(policy.rotation, arch.cached_vector_size, layer, device)
        if formats.k.quantized or formats.v.quantized
        else None
        for layer, formats in enumerate(layer_formats(arch, policy))
    ]


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
        rope_inv_freq: torch.Tensor | None = None,
    ) -> None:
        """rope_inv_freq: the model's RoPE speeds, needed to pool pre-RoPE summaries."""
        self.policy = policy
        self.blocks = blocks
        self.ops = ops
        self.device = device
        self.layers: list[LayerPools] = []
        bs, heads, size = policy.block_size, arch.cached_heads, arch.cached_vector_size
        counts = {kind: pool.num_blocks for kind, pool in blocks.pools.items()}
        self.rotations = layer_rotations(arch, policy, device)
        self.alignments = self._summary_alignments(rope_inv_freq)
        self.fetched_bytes = 0
        self.layer_topk = policy.layer_topk(arch.num_layers)
        self.layer_every = policy.layer_select_every(arch.num_layers)
        self.reuse_periods = sorted(set(self.layer_every) - {1})  # one anchor plan each a step
        self.kept = KeptBlocks(policy, heads, device) if policy.keeps else None
        all_formats = layer_formats(arch, policy)
        self.clips = ClipCounter(
            [
                (range_limit(f.k, k_scale), range_limit(f.v, v_scale))
                for f, (k_scale, v_scale) in zip(all_formats, tensor_scales, strict=True)
            ],
            torch.device(device),
        )
        self.layer_bytes = [layer_block_bytes(arch, f.k, f.v, bs) for f in all_formats]
        shared_stages: dict[tuple[KVFormat, KVFormat], tuple[KVPool, KVPool]] = {}
        for formats, (k_scale, v_scale), topk in zip(
            all_formats, tensor_scales, self.layer_topk, strict=True
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
            # A layer whose budget is 0 never reads an older block exactly: no index, no copies.
            if counts[INDEX] and topk:
                for pools, fmt, scale in (
                    (k_pools, formats.k_index, k_scale),
                    (v_pools, formats.v_index, v_scale),
                ):
                    if fmt is None:  # a means index: no V half
                        continue
                    scale = None if policy.separate_index else scale
                    pools[INDEX] = KVPool.allocate(
                        fmt, counts[INDEX], bs, heads, size, scale, device
                    )
            if counts[HOST] and topk:
                for pools, fmt, scale in (
                    (k_pools, formats.k, k_scale),
                    (v_pools, formats.v, v_scale),
                ):
                    pools[HOST] = _host_pool(fmt, counts[HOST], bs, heads, size, scale, device)
            if counts[STAGE]:
                shared = shared_stages.setdefault(
                    (formats.k, formats.v),
                    tuple(
                        KVPool.allocate(fmt, counts[STAGE], bs, heads, size, None, device)
                        for fmt in (formats.k, formats.v)
                    ),
                )
                # The layer's own tensor scale over the shared codes.
                k_pools[STAGE], v_pools[STAGE] = (
                    KVPool(pool.codes, pool.scales, pool.fmt, scale)
                    for pool, scale in zip(shared, (k_scale, v_scale), strict=True)
                )
            self.layers.append(LayerPools(k_pools, v_pools))

    def _summary_alignments(self, inv_freq: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Per layer, the turns that pool keys as if before RoPE (None: pooled as cached)."""
        policy = self.policy
        if not policy.compressed or policy.csa_summary != "pre_rope":
            return [None] * len(self.rotations)
        if inv_freq is None:
            raise ValueError("rope_inv_freq: needed for csa_summary=pre_rope")
        inv_freq = inv_freq.to(self.device)
        return [summary_alignment(inv_freq, policy.csa_ratio, r) for r in self.rotations]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every device pool tensor of every layer (codes and scales)."""
        return self._pool_bytes(lambda kind: kind != HOST)

    @property
    def host_allocated_bytes(self) -> int:
        """Bytes of the host tier's pools, every layer."""
        return self._pool_bytes(lambda kind: kind == HOST)

    def _pool_bytes(self, counted: Callable[[str], bool]) -> int:
        """Bytes of the pool tensors of the kinds counted, each shared tensor once."""
        tensors: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            for by_kind in (layer.k, layer.v):
                for kind, pool in by_kind.items():
                    if counted(kind):
                        for tensor in (pool.codes, pool.scales):
                            if tensor is not None:
                                tensors[tensor.data_ptr()] = tensor
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _int32(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def layout(
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
            copies=self._copy_groups(copies),
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
                    block_table=self._block_table([ids for ids, _, _ in per_seq]),
                    lengths=self._int32([length for _, length, _ in per_seq]),
                    start_positions=self._int32([start for _, _, start in per_seq]),
                    position_stride=stride,
                    logit_bias=math.log(ratio) if summary else 0.0,
                    shown_from=shown_from,
                    hidden_from=hidden_from,
                )
            )
        return specs

    def _copy_groups(self, copies: list[BlockCopy]) -> list[CopyGroup]:
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
                self._int32([c.src_block for c in group]),
                torch.tensor(
                    [s for c in group for s in c.dst_slots], dtype=torch.int64, device=self.device
                ),
            )
            for (src_kind, ratio, dst_kind, op), group in groups.items()
        ]

    def _run_copies(self, layer: int, groups: list[CopyGroup]) -> None:
        pools = self.layers[layer]
        bs = self.policy.block_size
        for group in groups:
            if group.dst_kind not in pools.k:  # the host tier or index of a layer without them
                continue
            rotation = self.rotations[layer] if self.policy.separate_index else None
            if group.op == "bounds":
                write_key_bounds(
                    pools.k[group.src_kind],
                    group.src_blocks,
                    pools.k[INDEX],
                    pools.v[INDEX],
                    group.dst_slots,
                    rotation,
                )
                continue
            if group.op == "means":
                keys = pools.k[group.src_kind]
                write_key_means(keys, group.src_blocks, pools.k[INDEX], group.dst_slots, rotation)
                continue
            for by_kind, align in ((pools.k, self.alignments[layer]), (pools.v, None)):
                source, target = by_kind[group.src_kind], by_kind[group.dst_kind]
                if group.dst_kind == HOST and source.fmt == target.fmt:
                    copy_blocks(source, group.src_blocks, target, group.dst_slots[::bs] // bs)
                    continue
                if group.dst_kind == HOST:  # from an fp16 recent block: quantized once, by torch
                    compress_blocks_ref(source, group.src_blocks, target, group.dst_slots, 1)
                    continue
                self.ops.compress_blocks(
                    source,
                    group.src_blocks,
                    target,
                    group.dst_slots,
                    group.ratio,
                    align if group.ratio > 1 else None,
                )

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        if len({len(r) for r in rows}) == 1 and rows[0]:  # one tensor at once (a decode step)
            return torch.tensor(rows, dtype=torch.int32, device=self.device)
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
        dtype, rotation = q.dtype, self.rotations[layer]
        q_model = q  # a separate key-bounds index is scored in the model's basis
        if rotation is not None:  # q.k is unchanged; the output is rotated back below
            q, k = rotate_queries(q, rotation), rotate(k, rotation)
            v = rotate(v, rotation) if rotation.rotates_values else v
        pools = self.layers[layer]
        tail = self.blocks.tail_kind
        self.clips.count(layer, k, v)
        self.ops.write_kv(k, v, layout.slot_mapping, pools.k[tail], pools.v[tail])
        self._run_copies(layer, layout.copies)
        streams = {
            spec.name + spec.kind: PagedStream(
                pools.k[spec.kind],
                # A means index has no V half: its stream gives its keys, which selection reads.
                pools.v.get(spec.kind, pools.k[spec.kind]),
                spec.block_table,
                spec.lengths,
                spec.start_positions,
                spec.position_stride,
                spec.logit_bias,
                spec.shown_from,
                spec.hidden_from,
            )
            for spec in layout.streams
            if spec.kind in pools.k
        }
        positions = None if layout.decode_only else layout.q_positions
        index = streams.pop("index" + INDEX, None)  # read by selection, not attended
        index = index or streams.get("summary" + MAIN)
        scored = q_model if self.policy.separate_index else q
        plan = layout.anchors.get(self.layer_every[layer])
        if plan is not None and plan.reselects and self.layer_topk[layer]:
            # Kept from the first step on, before any block is old enough to select.
            scored = scoring_queries(plan, layer, scored)
        if index is not None and self.policy.selects:
            self._select(layer, layout, scored, positions, scale, streams, index)
        if self.kept is not None:
            self._keep(layer, layout, q, scale, streams)
        out = self.ops.attention(
            q, positions, layout.q_seq_starts, list(streams.values()), scale, layout.max_q_len
        )
        if rotation is not None and rotation.rotates_values:
            out = unrotate(out, rotation)
        return out.to(dtype)

    def _keep(
        self,
        layer: int,
        layout: StepLayout,
        q: torch.Tensor,
        scale: float,
        streams: dict[str, PagedStream],
    ) -> None:
        """Count this step's window attention, fill the kept blocks of groups decided now, and
        show the kept blocks in place of their summaries."""
        kept, pools = self.kept, self.layers[layer]
        window = [stream for key, stream in streams.items() if key.startswith("window")]
        kept.observe(
            layer,
            layout.kvs,
            q,
            layout.q_positions,
            layout.q_seq_starts,
            window,
            scale,
            layout.decode_only,
        )
        kept.decide(layer, layout.kvs, pools.k[MAIN], pools.v[MAIN])
        shown = kept.apply(
            layer,
            layout.kvs,
            layout.q_positions,
            layout.q_seq_starts,
            streams.get("summary" + MAIN),
            pools.k[MAIN],
            pools.v[MAIN],
        )
        for name, stream in shown.items():
            streams[name + MAIN] = stream

    def _select(
        self,
        layer: int,
        layout: StepLayout,
        q: torch.Tensor,
        positions: torch.Tensor | None,
        scale: float,
        streams: dict[str, PagedStream],
        index: PagedStream,
    ) -> None:
        """Each query's older blocks (the layer's budget), scored on `index` (key bounds, means
        or summaries) with q in the index's basis (each query's anchor query, `select_anchors`):
        their summaries (if any) hidden from it, their exact form shown (in place in the host
        tier for a prefill step, fetched for a decode step). A layer whose budget is 0 reads
        what a compressed layer without selection reads."""
        policy = self.policy
        bs = policy.block_size
        per_block = bs // policy.csa_ratio
        summary_key, host_key = "summary" + MAIN, "host" + HOST
        topk = self.layer_topk[layer]
        if topk == 0:  # the layer holds no host tier
            return
        plan = layout.anchors.get(self.layer_every[layer])
        reuses = positions is None and plan is not None and not plan.reselects
        if reuses:
            chosen = self._last_choices(layer, layout.kvs)
        else:
            chosen = select_blocks(
                q,
                positions,
                layout.q_seq_starts,
                index,
                per_block if policy.csa_index == "summaries" else 1,
                topk,
                scale,
                policy.csa_index,
                self.ops.index_products,
            )
        if policy.summarises:
            streams[summary_key] = dataclasses.replace(
                streams[summary_key], query_mask=~chosen.repeat_interleave(per_block, dim=2)
            )
        host = streams.pop(host_key)
        if positions is not None:
            if self._host_is_remote(host):
                host = self._fetch_for_prefill(layer, host)
            streams[host_key] = dataclasses.replace(
                host, query_mask=chosen.repeat_interleave(bs, dim=2)
            )
            return
        if reuses:
            staged = self._restage(layer, layout.kvs)
        else:
            rows = chosen.tolist()
            if plan is not None:
                for kv, row in zip(layout.kvs, rows, strict=True):
                    kv.choices[layer] = row
            staged = self._fetch(layer, layout.kvs, rows)
        pools, kind = self.layers[layer], self.blocks.staging_kind
        streams["staging" + MAIN] = PagedStream(
            pools.k[kind],
            pools.v[kind],
            self._block_table(staged),
            self._int32([len(ids) * bs for ids in staged]),
            host.start_positions,
        )

    def _last_choices(self, layer: int, kvs: list[SequenceKV]) -> torch.Tensor | None:
        """bool [S, Hkv, blocks]: the choices of the sequences' last decode selection in
        `layer`, for the summaries they hide (None without summaries: only staging reads
        them). Each row is as wide as its batch's longest then, and no sequence has gained an
        older block since, so the widest row covers every sequence now."""
        if not self.policy.summarises:
            return None
        rows = [kv.choices[layer] for kv in kvs]
        width = max(len(heads[0]) for heads in rows)
        padded = [[head + [False] * (width - len(head)) for head in heads] for heads in rows]
        return torch.tensor(padded, dtype=torch.bool, device=self.device)

    def _restage(self, layer: int, kvs: list[SequenceKV]) -> list[list[int]]:
        """The staging blocks of each sequence's last choice in `layer`, made again: a
        resident pool still holds it; a streamed one holds the previous layer's blocks and
        fetches it again."""
        if self.blocks.staging_kind == STAGE:
            return self._fetch(layer, kvs, [kv.choices[layer] for kv in kvs])
        return [kv.staging_blocks[: self.layer_topk[layer]] for kv in kvs]

    def _host_is_remote(self, host: PagedStream) -> bool:
        """Whether the host tier lives off the device (pinned host memory beside a GPU), where
        the kernels cannot read it in place."""
        return host.k.codes.device != self.device

    def _fetch_for_prefill(self, layer: int, host: PagedStream) -> PagedStream:
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

    def _fetch(
        self, layer: int, kvs: list[SequenceKV], choices: list[list[list[bool]]]
    ) -> list[list[int]]:
        """The staging blocks of each sequence in one layer, each KV head's slice of them
        holding a block that head chose: slices not staged yet are fetched from the host tier
        into slices whose block that head no longer chose, for all sequences in one copy per
        tensor (a copy per sequence made a batch's fetch cost calls, not bytes). A decode query
        sees every older block, so each head chose min(the layer's budget, blocks): exactly
        the first staging blocks (all of them where the budget is csa_topk)."""
        kind = self.blocks.staging_kind
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

    def apply_copies(self, copies: list[BlockCopy], kvs: list[SequenceKV]) -> None:
        """Execute compressions and recent->main moves on every layer, and the keep decisions
        of kvs (sources freed by caller)."""
        groups = self._copy_groups(copies)
        for layer in range(len(self.layers)):
            self._run_copies(layer, groups)
            if self.kept is not None:
                pools = self.layers[layer]
                self.kept.decide(layer, kvs, pools.k[MAIN], pools.v[MAIN])


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


def _host_pool(
    fmt: KVFormat,
    num_blocks: int,
    block_size: int,
    heads: int,
    size: int,
    tensor_scale: torch.Tensor | None,
    device: torch.device,
) -> KVPool:
    """A host-tier pool in the layer's format: pinned host memory beside a CUDA device, the
    same memory on a CPU."""
    scale = None if tensor_scale is None else tensor_scale.cpu()
    pool = KVPool.allocate(fmt, num_blocks, block_size, heads, size, scale, "cpu")
    if device.type != "cuda":
        return pool
    scales = None if pool.scales is None else pool.scales.pin_memory()
    return KVPool(pool.codes.pin_memory(), scales, fmt, scale)
