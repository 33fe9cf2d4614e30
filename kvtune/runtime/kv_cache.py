"""The paged KV cache of every layer, and attention over it for one engine step.

The pools (cache_pools.py), a step's streams (step_layout.py), its maintenance copies
(block_copies.py), CSA selection (block_selection.py) with its host-tier fetches
(host_fetch.py) and importance keeping (kept_blocks.py) each live in their own module; this
facade allocates the pools and, layer by layer, writes a step's keys and values, runs its
copies and attends. Attention is one softmax over all of a sequence's streams (DESIGN.md
section 3): the Triton backend attends each stream and merges the partial results by
log-sum-exp, the torch backend concatenates them.
"""

from __future__ import annotations

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.rope_align import summary_alignment
from kvtune.kernels.formats.ggml_queries import round_queries
from kvtune.kernels.formats.rotation import rotate, rotate_queries, unrotate
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.backends import CacheOps
from kvtune.runtime.block_copies import CopyGroup, copy_groups, run_copies
from kvtune.runtime.block_manager import BlockCopy, BlockManager, SequenceKV
from kvtune.runtime.block_selection import BlockSelection
from kvtune.runtime.cache_pools import (
    allocate_layer_pools,
    layer_rotations,
    pool_tensor_bytes,
)
from kvtune.runtime.clip_counter import ClipCounter, range_limit
from kvtune.runtime.host_fetch import HostFetch
from kvtune.runtime.kept_blocks import KeptBlocks
from kvtune.runtime.kv_bytes import layer_block_bytes, layer_formats
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN
from kvtune.runtime.select_anchors import scoring_queries
from kvtune.runtime.step_layout import StepLayout, StepLayouts


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
        """Pools of the block manager's sizes (the engine's plan, kvtune/runtime/pool_plan.py).
        rope_inv_freq: the model's RoPE speeds, needed to pool pre-RoPE summaries."""
        self.policy = policy
        self.blocks = blocks
        self.ops = ops
        self.device = device
        counts = {kind: pool.num_blocks for kind, pool in blocks.pools.items()}
        self.rotations = layer_rotations(arch, policy, device)
        self.alignments = self._summary_alignments(rope_inv_freq)
        self.layer_topk = policy.layer_topk(arch.num_layers)
        self.layer_every = policy.layer_select_every(arch.num_layers)
        reuse_periods = sorted(set(self.layer_every) - {1})  # one anchor plan each a step
        self.layouts = StepLayouts(policy, device, reuse_periods)
        self.kept = KeptBlocks(policy, arch.cached_heads, device) if policy.keeps else None
        all_formats = layer_formats(arch, policy)
        # llama.cpp's K types meet 8-bit queries (kvtune/kernels/formats/ggml_queries.py).
        self.rounds_queries = [f.k.element.ggml_block for f in all_formats]
        self.clips = ClipCounter(
            [
                (range_limit(f.k, k_scale), range_limit(f.v, v_scale))
                for f, (k_scale, v_scale) in zip(all_formats, tensor_scales, strict=True)
            ],
            torch.device(device),
        )
        self.layers = allocate_layer_pools(arch, policy, counts, tensor_scales, device)
        layer_bytes = [layer_block_bytes(arch, f.k, f.v, policy.block_size) for f in all_formats]
        self.fetch = HostFetch(
            self.layers, blocks.staging_kind, self.layer_topk, layer_bytes, device
        )
        key_bytes = [layer_block_bytes(arch, f.k, None, policy.block_size) for f in all_formats]
        self.selection = BlockSelection(
            policy, self.layers, self.fetch, self.layer_topk, self.layer_every, key_bytes, device
        )

    def _summary_alignments(self, inv_freq: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Per layer, the turns that pool keys as if before RoPE (None: pooled as cached)."""
        policy = self.policy
        if not policy.compressed or policy.csa_summary != "pre_rope":
            return [None] * len(self.rotations)
        if inv_freq is None:
            raise ValueError("rope_inv_freq: needed for csa_summary=pre_rope")
        inv_freq = inv_freq.to(self.device)
        return [summary_alignment(inv_freq, policy.csa_ratio, r.keys) for r in self.rotations]

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every device pool tensor of every layer (codes and scales)."""
        return pool_tensor_bytes(self.layers, lambda kind: kind != HOST)

    @property
    def host_allocated_bytes(self) -> int:
        """Bytes of the host tier's pools, every layer."""
        return pool_tensor_bytes(self.layers, lambda kind: kind == HOST)

    @property
    def fetched_bytes(self) -> int:
        """Bytes copied from the host tier to the device so far."""
        return self.fetch.fetched_bytes

    @property
    def rescored_bytes(self) -> int:
        """Host-tier key bytes read so far to rescore shortlists (policy.csa_rescore)."""
        return self.selection.rescored_bytes

    def layout(
        self,
        kvs: list[SequenceKV],
        slots: list[list[int]],
        positions: list[list[int]],
        copies: list[BlockCopy],
    ) -> StepLayout:
        """This step's layout (StepLayouts.build), built once and reused by every layer."""
        return self.layouts.build(kvs, slots, positions, copies)

    def _run_copies(self, layer: int, groups: list[CopyGroup]) -> None:
        run_copies(
            self.layers[layer],
            groups,
            self.policy,
            self.ops,
            self.rotations[layer].keys,
            self.alignments[layer],
        )

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
        if rotation.keys is not None:  # q.k is unchanged
            q, k = rotate_queries(q, rotation.keys), rotate(k, rotation.keys)
        if rotation.values is not None:  # the output is rotated back below
            v = rotate(v, rotation.values)
        if self.rounds_queries[layer]:
            q = round_queries(q)
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
        exact = scored  # csa_rescore scores the host tier's keys, in the cache's space
        rescores_rotated = self.policy.csa_rescore > 1 and rotation.keys is not None
        if rescores_rotated and self.policy.separate_index:
            exact = rotate_queries(scored, rotation.keys)
        if index is not None and self.policy.selects:
            self.selection.select(
                layer,
                layout,
                scored,
                exact,
                positions,
                scale,
                streams,
                index,
                self.ops.index_products,
            )
        if self.kept is not None:
            self._keep(layer, layout, q, scale, streams)
        out = self.ops.attention(
            q, positions, layout.q_seq_starts, list(streams.values()), scale, layout.max_q_len
        )
        if rotation.values is not None:
            out = unrotate(out, rotation.values)
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

    def apply_copies(self, copies: list[BlockCopy], kvs: list[SequenceKV]) -> None:
        """Execute compressions and recent->main moves on every layer, and the keep decisions
        of kvs (sources freed by caller)."""
        groups = copy_groups(copies, self.device)
        for layer in range(len(self.layers)):
            self._run_copies(layer, groups)
            if self.kept is not None:
                pools = self.layers[layer]
                self.kept.decide(layer, kvs, pools.k[MAIN], pools.v[MAIN])
