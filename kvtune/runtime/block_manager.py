"""Paged block bookkeeping: which pool blocks each sequence's streams hold, and when they move.

Block ids are shared by every layer (block 7 is block 7 in each layer's pool), so one manager
serves all layers. The layout follows runtime/kv_bytes.py exactly, which is what makes the bytes a
sequence holds equal the planner's figure after every step:
- new tokens go to the tail of the sink stream (positions < csa_sinks, when compressing) or of
  the window stream, into the fp16 "recent" pool when recent_unquantized > 0 or keys are scaled
  per channel (policy.recent_tail), else the main pool;
- blocks that hold none of the last recent_unquantized tokens move to the main pool, and window
  blocks that left the window are pooled into the summary stream (in that order, so a block that
  crosses both thresholds at once is pooled from the codes decode would have pooled).
`maintain(kv, upto)` brings the layout to what decode has once `upto` tokens are cached. The
engine calls it before a step's attention with upto = the chunk's last position (so every
prefill position sees what decode shows it) and after the step with upto = all tokens. Blocks
that leave a stream before the attention stay readable until `release`: `SequenceKV.retiring`
lists them, and the cache shows each to the positions that decode would show it to.
With selection (policy.selects) a block pooled into summaries is also copied into the host
tier (`SequenceKV.host_blocks`, in order of position from csa_sinks on), its key bounds or mean
key go to a slot of the index pool (`SequenceKV.index_blocks`, block_size slots a block), and
the sequence holds min(csa_topk, pooled blocks) main-pool staging blocks into which each layer
fetches the blocks its queries select (`SequenceKV.staged`: per layer and KV head, the host
block whose head slice each staging block holds); with a streamed staging pool
(policy.streams_staging) those blocks come from the STAGE pool, which the layers share.
Without summaries (csa_summary none) a block leaving the window only moves to the host tier.
With importance keeping (policy.keeps), pooling the first block of each group of KEEP_GROUP older
blocks allocates csa_keep * KEEP_GROUP main-pool blocks (`SequenceKV.keep_blocks`) and records the
group's blocks as candidates (`SequenceKV.pending_keeps`): every block of the group is complete
and quantized by then, and the KV cache copies into them, per layer and KV head, the candidates
that received the most attention.
The manager only decides; the KV cache executes the returned copy operations on every layer and
then calls `release` for their source blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtune.runtime.kv_bytes import ceil_div, compressed_blocks, exact_extents, sequence_blocks
from kvtune.runtime.policy import KEEP_GROUP, KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, RECENT, STAGE

if TYPE_CHECKING:
    import torch


class BlockPool:
    """Free list of block ids of one pool, with a high-water mark."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV pool exhausted: the scheduler admitted more than fits")
        block_id = self._free.popleft()
        self.peak_used = max(self.peak_used, self.num_used)
        return block_id

    def release(self, block_id: int) -> None:
        self._free.append(block_id)


@dataclass
class Block:
    kind: str  # MAIN or RECENT
    block_id: int


@dataclass
class ExactStream:
    """Exact tokens [start, start + length) in consecutive blocks; older blocks come first."""

    start: int
    blocks: list[Block] = field(default_factory=list)
    length: int = 0


@dataclass(frozen=True)
class RetiringBlock:
    """An exact block that left `stream` ("sinks" or "window") in this step's maintenance:
    demoted (its recent copy) or pooled into summaries; readable until `release`."""

    stream: str
    first_position: int
    block: Block


@dataclass(frozen=True)
class KeepGroup:
    """A group of KEEP_GROUP older blocks whose importance-kept copies are decided now.

    first: older-block index (counted from csa_sinks) of the group's first block; candidates:
    the main-pool ids of its blocks, in order; slots: the index in SequenceKV.keep_blocks of
    the first of the group's kept blocks (they are consecutive)."""

    first: int
    candidates: tuple[int, ...]
    slots: int


@dataclass
class SequenceKV:
    """The blocks one sequence holds. `sinks` is used only when the policy compresses."""

    sinks: ExactStream = field(default_factory=lambda: ExactStream(0))
    window: ExactStream = field(default_factory=lambda: ExactStream(0))
    summary_blocks: list[int] = field(default_factory=list)
    num_summaries: int = 0
    num_tokens: int = 0
    retiring: list[RetiringBlock] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    index_blocks: list[int] = field(default_factory=list)
    staging_blocks: list[int] = field(default_factory=list)
    staged: dict[int, list[dict[int, int]]] = field(default_factory=dict)
    keep_blocks: list[int] = field(default_factory=list)
    pending_keeps: list[KeepGroup] = field(default_factory=list)
    # Per layer: [keep blocks, KV heads] older-block index each kept slice holds, and
    # [KV heads, older blocks] attention received so far (kept by the KV cache).
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    importance: dict[int, torch.Tensor] = field(default_factory=dict)
    # Selection reused across positions (kvtune.runtime.select_anchors): per layer, the latest
    # anchor's scoring query and the last decode choice [KV heads][older blocks]; per N, the
    # (anchor, older blocks) the choices of layers reusing for N positions were made for
    # (None: nothing staged to reuse).
    anchor_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    choices: dict[int, list[list[bool]]] = field(default_factory=dict)
    selected_for: dict[int, tuple[int, int] | None] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockCopy:
    """Pool `ratio` consecutive tokens of a source block into one destination slot each of
    the dst_kind pool.

    ratio 1 is a (re)quantizing copy, used when a block leaves the fp16 recent region, or the
    copy of a pooled block into the host tier (which leaves the source to its pooling copy).
    op "bounds" writes the block's per-channel key max (K) and min (V) into one slot of the
    index pool instead, op "means" its mean key (K only).
    The source block is released once every layer has executed the copy, if frees_source.
    """

    src_kind: str
    src_block: int
    dst_slots: tuple[int, ...]
    ratio: int
    dst_kind: str = MAIN
    frees_source: bool = True
    op: str = "mean"


@dataclass(frozen=True)
class BlockNeeds:
    main: int
    recent: int
    host: int = 0
    index: int = 0
    stage: int = 0


class BlockManager:
    """Allocates blocks for sequences under one policy and plans their compressions and moves."""

    def __init__(
        self,
        policy: KVPolicy,
        num_main_blocks: int,
        num_recent_blocks: int,
        num_host_blocks: int = 0,
        num_index_blocks: int = 0,
        num_stage_blocks: int = 0,
    ) -> None:
        self.policy = policy
        self.pools = {
            MAIN: BlockPool(num_main_blocks),
            RECENT: BlockPool(num_recent_blocks),
            HOST: BlockPool(num_host_blocks),
            INDEX: BlockPool(num_index_blocks),
            STAGE: BlockPool(num_stage_blocks),
        }
        self.staging_kind = STAGE if policy.streams_staging else MAIN
        self.tail_kind = RECENT if policy.recent_tail else MAIN

    def new_sequence(self) -> SequenceKV:
        return SequenceKV(sinks=ExactStream(0), window=ExactStream(self._sink_count()))

    def _sink_count(self) -> int:
        return self.policy.csa_sinks if self.policy.compressed else 0

    def _new_tail_blocks(self, kv: SequenceKV, num_new: int) -> int:
        """Blocks appending num_new tokens adds before any compression or move."""
        bs = self.policy.block_size
        sinks = self._sink_count()
        end = kv.num_tokens + num_new
        sink_before = ceil_div(min(kv.num_tokens, sinks), bs)
        sink_after = ceil_div(min(end, sinks), bs)
        window_before = ceil_div(max(0, kv.num_tokens - kv.window.start), bs)
        window_after = ceil_div(max(0, end - kv.window.start), bs)
        return sink_after - sink_before + window_after - window_before

    def needs(self, kv: SequenceKV, num_new: int) -> BlockNeeds:
        """Free blocks each pool must have for kv to take num_new more tokens this step.

        The main pool peaks after maintenance and before `release`: the new layout plus the
        blocks just pooled into summaries, which are freed only once every layer has copied them.
        """
        held = self.held(kv)
        end = kv.num_tokens + num_new
        # Two maintenances: up to end - 1 before the attention (its sources held until the
        # attention is done), then up to end.
        after = sequence_blocks(self.policy, end)
        newly_compressed = compressed_blocks(self.policy, end) - compressed_blocks(
            self.policy, kv.num_tokens
        )
        peak_main = newly_compressed + max(
            self._main_blocks_before_attention(end), after.quantized + after.summary
        )
        peak_main += after.staging + after.kept
        peak_recent = held[RECENT]
        if self.tail_kind == RECENT:
            peak_recent += self._new_tail_blocks(kv, num_new)
        return BlockNeeds(
            main=max(0, peak_main - held[MAIN]),
            recent=max(0, peak_recent - held[RECENT]),
            host=max(0, after.host - held[HOST]),
            index=max(0, after.index - held[INDEX]),
            stage=max(0, after.streamed - held[STAGE]),
        )

    def _main_blocks_before_attention(self, end: int) -> int:
        """Main blocks of a sequence of `end` tokens maintained up to end - 1: that layout, plus
        the block the last token may open when new tokens go straight to the main pool (when
        they go to the recent pool it holds them)."""
        before = sequence_blocks(self.policy, end - 1)
        opened = 0
        if self.tail_kind == MAIN:
            last = exact_extents(self.policy, end - 1)[-1]
            bs = self.policy.block_size
            opened = ceil_div(last.length + 1, bs) - ceil_div(last.length, bs)
        return before.quantized + before.summary + opened

    def can_append(self, kv: SequenceKV, num_new: int) -> bool:
        need = self.needs(kv, num_new)
        return (
            need.main <= self.pools[MAIN].num_free
            and need.recent <= self.pools[RECENT].num_free
            and need.host <= self.pools[HOST].num_free
            and need.index <= self.pools[INDEX].num_free
            and need.stage <= self.pools[STAGE].num_free
        )

    def held(self, kv: SequenceKV) -> dict[str, int]:
        counts = {
            MAIN: len(kv.summary_blocks) + len(kv.keep_blocks),
            RECENT: 0,
            HOST: len(kv.host_blocks),
            INDEX: len(kv.index_blocks),
            STAGE: 0,
        }
        counts[self.staging_kind] += len(kv.staging_blocks)
        for block in kv.sinks.blocks + kv.window.blocks:
            counts[block.kind] += 1
        return counts

    def append(self, kv: SequenceKV, num_new: int) -> list[int]:
        """Reserve slots for the next num_new tokens; returns their slot ids in the tail pool."""
        bs = self.policy.block_size
        sinks = self._sink_count()
        slots = []
        for position in range(kv.num_tokens, kv.num_tokens + num_new):
            stream = kv.sinks if position < sinks else kv.window
            index = position - stream.start
            if index // bs == len(stream.blocks):
                stream.blocks.append(Block(self.tail_kind, self.pools[self.tail_kind].allocate()))
            slots.append(stream.blocks[index // bs].block_id * bs + index % bs)
            stream.length = index + 1
        kv.num_tokens += num_new
        return slots

    def maintain(self, kv: SequenceKV, upto: int | None = None) -> list[BlockCopy]:
        """Bring kv to the layout decode has with `upto` tokens cached (default: all): move
        blocks that left the recent region, then pool blocks that left the window. Returns the
        copies, in the order they must run."""
        upto = kv.num_tokens if upto is None else upto
        return self._demote(kv, upto) + self._compress(kv, upto)

    def _compress(self, kv: SequenceKV, upto: int) -> list[BlockCopy]:
        policy = self.policy
        bs = policy.block_size
        done = (kv.window.start - self._sink_count()) // bs
        copies = []
        for pooled in range(done, compressed_blocks(policy, upto)):
            if policy.keeps and pooled % KEEP_GROUP == 0:
                self._open_keep_group(kv, pooled)
            source = kv.window.blocks.pop(0)
            kv.retiring.append(RetiringBlock("window", kv.window.start, source))
            kv.window.start += bs
            kv.window.length -= bs
            if policy.selects:
                copies.extend(self._keep_on_host(kv, source))
            if policy.summarises:
                copies.append(self._pool(kv, source))
        return copies

    def _pool(self, kv: SequenceKV, source: Block) -> BlockCopy:
        """The copy pooling a block that left the window into its summaries (it frees the
        block)."""
        bs, ratio = self.policy.block_size, self.policy.csa_ratio
        dst_slots = []
        for _ in range(bs // ratio):
            index = kv.num_summaries
            if index // bs == len(kv.summary_blocks):
                kv.summary_blocks.append(self.pools[MAIN].allocate())
            dst_slots.append(kv.summary_blocks[index // bs] * bs + index % bs)
            kv.num_summaries += 1
        return BlockCopy(source.kind, source.block_id, tuple(dst_slots), ratio)

    def _open_keep_group(self, kv: SequenceKV, first: int) -> None:
        """Allocate the kept blocks of the group starting at older block `first` (about to be
        pooled) and list its blocks, all complete and in the main pool (policy checks)."""
        candidates = kv.window.blocks[:KEEP_GROUP]
        if len(candidates) < KEEP_GROUP or any(block.kind != MAIN for block in candidates):
            raise RuntimeError(f"keep group at older block {first}: {candidates} not all main")
        slots = len(kv.keep_blocks)
        for _ in range(self.policy.kept_per_group):
            kv.keep_blocks.append(self.pools[MAIN].allocate())
        ids = tuple(block.block_id for block in candidates)
        kv.pending_keeps.append(KeepGroup(first, ids, slots))

    def _keep_on_host(self, kv: SequenceKV, source: Block) -> list[BlockCopy]:
        """Copy a block leaving the window into the host tier (and its key bounds into the
        index), and grow the staging pool with it."""
        bs = self.policy.block_size
        host = self.pools[HOST].allocate()
        kv.host_blocks.append(host)
        if len(kv.staging_blocks) < min(self.policy.csa_topk, len(kv.host_blocks)):
            kv.staging_blocks.append(self.pools[self.staging_kind].allocate())
        slots = tuple(range(host * bs, (host + 1) * bs))
        # Without summaries no pooling copy follows: this one frees the block.
        frees = not self.policy.summarises
        copies = [BlockCopy(source.kind, source.block_id, slots, 1, HOST, frees_source=frees)]
        if self.policy.pooled_index:
            index = len(kv.host_blocks) - 1
            if index // bs == len(kv.index_blocks):
                kv.index_blocks.append(self.pools[INDEX].allocate())
            slot = kv.index_blocks[index // bs] * bs + index % bs
            copies.append(
                BlockCopy(
                    source.kind,
                    source.block_id,
                    (slot,),
                    bs,
                    INDEX,
                    frees_source=False,
                    op=self.policy.csa_index,
                )
            )
        return copies

    def _demote(self, kv: SequenceKV, upto: int) -> list[BlockCopy]:
        """Quantize recent blocks that are done and hold none of the last recent_unquantized
        tokens (with per-channel key scales and no recent region: every full block). When
        the recent region is longer than the CSA window, a window block is pooled straight from
        its recent copy before it would be demoted, so window blocks are left to _compress."""
        policy = self.policy
        bs = policy.block_size
        oldest_recent = upto - policy.recent_unquantized
        streams = {"sinks": kv.sinks, "window": kv.window}
        if policy.compressed and policy.recent_unquantized > policy.csa_window:
            del streams["window"]
        copies = []
        for name, stream in streams.items():
            # A block ends at its boundary (a partial block is not done), the sink stream's last
            # block where the sinks end.
            stream_end = self._sink_count() if name == "sinks" else None
            for index, block in enumerate(stream.blocks):
                block_end = stream.start + (index + 1) * bs
                if stream_end is not None:
                    block_end = min(block_end, stream_end)
                if block.kind != RECENT or block_end > oldest_recent:
                    continue
                target = self.pools[MAIN].allocate()
                slots = tuple(range(target * bs, (target + 1) * bs))
                copies.append(BlockCopy(RECENT, block.block_id, slots, 1))
                kv.retiring.append(RetiringBlock(name, stream.start + index * bs, block))
                stream.blocks[index] = Block(MAIN, target)
        return copies

    def release(self, copies: list[BlockCopy], kvs: list[SequenceKV]) -> None:
        """Free the source blocks of executed copies (the retiring blocks of kvs)."""
        for copy in copies:
            if copy.frees_source:
                self.pools[copy.src_kind].release(copy.src_block)
        for kv in kvs:
            kv.retiring.clear()
            kv.pending_keeps.clear()

    def free(self, kv: SequenceKV) -> None:
        """Return every block of a finished or preempted sequence."""
        for block in kv.sinks.blocks + kv.window.blocks:
            self.pools[block.kind].release(block.block_id)
        for block_id in kv.summary_blocks + kv.keep_blocks:
            self.pools[MAIN].release(block_id)
        for block_id in kv.staging_blocks:
            self.pools[self.staging_kind].release(block_id)
        for block_id in kv.index_blocks:
            self.pools[INDEX].release(block_id)
        for block_id in kv.host_blocks:
            self.pools[HOST].release(block_id)
        kv.sinks.blocks.clear()
        kv.window.blocks.clear()
        kv.summary_blocks.clear()
        kv.staging_blocks.clear()
        kv.index_blocks.clear()
        kv.host_blocks.clear()
        kv.staged.clear()
        kv.keep_blocks.clear()
        kv.pending_keeps.clear()
        kv.kept.clear()
        kv.importance.clear()
