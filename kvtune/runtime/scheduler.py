"""Continuous batching: which sequences run this step, with how many tokens each.

Each step schedules every running decode first (one token each), then prefill chunks within the
per-step token budget: chunks of at most chunk_size tokens, cut at block boundaries. When the
cache runs out, the lowest-priority running sequence is preempted and later recomputed. Blocks
are reserved here, at scheduling time, so a scheduled batch always fits.

Admission order: `fcfs` (arrival order) or `length_aware` (shortest prompt first, so a long
prompt cannot hold up many short ones). Both are starvation-free: a request that has waited
`starvation_steps` steps is admitted before any newer one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtune.runtime.block_manager import BlockManager, SequenceKV
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.pool_kinds import MAIN, RECENT
from kvtune.runtime.sequence import Sequence, SequenceStatus

SCHEDULING_POLICIES = ("fcfs", "length_aware")


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int
    slots: list[int]


@dataclass
class Pending:
    """Blocks promised to this step's sequences but taken only after the forward pass."""

    main: int = 0
    recent: int = 0


class Scheduler:
    """Decides each step's batch and owns the waiting and running queues."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        starvation_steps: int = 32,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ConfigError("scheduling", policy, f"one of {', '.join(SCHEDULING_POLICIES)}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.starvation_steps = starvation_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv: dict[int, SequenceKV] = {}
        self.num_preemptions = 0
        self._pending = Pending()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        """Reserve blocks for num_tokens more tokens of seq, or None if the cache cannot."""
        kv = self.kv[seq.seq_id]
        need = self.blocks.needs(kv, num_tokens)
        pools = self.blocks.pools
        if (
            need.main + self._pending.main > pools[MAIN].num_free
            or need.recent + self._pending.recent > pools[RECENT].num_free
        ):
            return None
        free_before = pools[MAIN].num_free, pools[RECENT].num_free
        slots = self.blocks.append(kv, num_tokens)
        self._pending.main += need.main - (free_before[0] - pools[MAIN].num_free)
        self._pending.recent += need.recent - (free_before[1] - pools[RECENT].num_free)
        return slots

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's prefill to run now: whole blocks unless it finishes the prompt."""
        chunk_size = self.blocks.policy.chunk_size
        block_size = self.blocks.policy.block_size
        num = min(seq.num_uncached, chunk_size, budget)
        if num < seq.num_uncached:
            num -= (seq.num_cached + num) % block_size
        return max(num, 0)

    def preempt(self, seq: Sequence) -> None:
        """Free seq's cache and requeue it first; it will be recomputed from its tokens."""
        self.running.remove(seq)
        self.blocks.free(self.kv.pop(seq.seq_id))
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(self.kv.pop(seq.seq_id))
        seq.status = SequenceStatus.FINISHED

    def _next_waiting(self) -> Sequence:
        starved = [s for s in self.waiting if s.waited_steps >= self.starvation_steps]
        if self.policy == "fcfs" or starved:
            return starved[0] if starved else self.waiting[0]
        return min(self.waiting, key=lambda s: (s.num_uncached, s.metrics.arrival))

    def schedule(self) -> list[ScheduledSequence]:
        """This step's batch, with its blocks reserved. Empty only when nothing is queued."""
        while True:
            batch = self._schedule_once()
            if batch or not self.running:
                break
            # Every running prefill is stuck waiting for blocks: recompute the newest later.
            self.preempt(self.running[-1])
        for seq in self.waiting:
            seq.waited_steps += 1
        return batch

    def _schedule_once(self) -> list[ScheduledSequence]:
        self._pending = Pending()
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted to make room for an earlier sequence
            num = self._chunk(seq, budget) if seq.is_prefill else 1
            slots = self._reserve(seq, num) if num else None
            while slots is None and num and not seq.is_prefill and seq in self.running:
                self.preempt(self.running[-1])
                if seq in self.running:
                    slots = self._reserve(seq, num)
            if slots is not None:
                batch.append(ScheduledSequence(seq, num, slots))
                budget -= num
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self._next_waiting()
            self.kv[seq.seq_id] = self.blocks.new_sequence()
            num = self._chunk(seq, budget)
            slots = self._reserve(seq, num) if num else None
            if slots is None:
                del self.kv[seq.seq_id]
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSequence(seq, num, slots))
            budget -= num
        return batch
