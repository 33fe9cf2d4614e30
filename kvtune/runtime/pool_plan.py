"""Every pool of the paged KV cache in blocks and bytes: the one sizing the engine allocates
(its block manager and KV cache take exactly these blocks) and the capacity planner counts.

The engine sets aside, for each of max_num_seqs sequences, what one max_model_len sequence
holds (kv_bytes.sequence_blocks) and a step's slack; a byte budget gives the main pool what
the rest leaves. Beyond max_num_seqs x kv_bytes_per_sequence(max_model_len) that is exactly
(step_blocks = ceil(step_tokens / block_size)):
- main pool: one block a sequence (within a step a sequence may open a block, or still hold
  one it pooled until every layer has copied it) and step_blocks blocks once, for a step's
  new tokens, which the batch shares. One sequence with that slack (step_blocks + 1 blocks
  beyond its own) is the least a budget must leave the main pool;
- fp16 recent pool (policy.recent_tail): ceil(recent_unquantized / block_size) + 3 blocks a
  sequence in place of the recent blocks it holds at max_model_len (the region unaligned,
  split over the sink and window streams, and a block opened before the step demotes one),
  and step_blocks blocks once, for a step's new tokens;
- prefill scratch (host_tier_remote: the host tier in host memory, off the device): a prefill
  step copies the host blocks its sequences hold to the device one layer at a time, so at most
  the host tier's blocks in the largest selecting layer's formats. A transient tensor, not a
  pool: counted against the budget, not in KVCache.allocated_bytes.
The index, streamed staging and host-tier pools hold exactly max_num_seqs sequences' blocks:
the index and staging cost little beside the main pool, so they are set aside whole rather than
competing with it, and host memory is not the scarce resource the device budget is, so the tier
never refuses a sequence the device pools admit. With that slack max_num_seqs full-length
sequences run together without preemption (tests/runtime/test_pool_plan.py). Units: blocks and
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress

from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import (
    block_bytes,
    ceil_div,
    layer_block_bytes,
    layer_formats,
    selecting_layers,
    sequence_blocks,
)
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import DEVICE_KINDS, HOST, MAIN, POOL_KINDS, RECENT


@dataclass(frozen=True)
class PoolLimits:
    """What the engine sizes its pools for: max_num_seqs sequences of up to max_model_len
    tokens, at most step_tokens tokens a step (max_num_batched_tokens, else chunk_size), and
    whether the host tier lives off the device (host memory beside a GPU)."""

    max_num_seqs: int
    max_model_len: int
    step_tokens: int
    host_tier_remote: bool = False


@dataclass(frozen=True)
class PoolReserve:
    """Blocks of each pool (pool_kinds) the engine sets aside for every sequence it may run
    and once for them all; bytes of one block id of each pool (all layers); the prefill
    scratch bytes each sequence may add."""

    per_sequence: dict[str, int]
    shared: dict[str, int]
    block_bytes: dict[str, int]
    scratch_per_sequence: int

    def blocks(self, num_seqs: int) -> dict[str, int]:
        """Blocks of each pool for num_seqs sequences."""
        return {kind: num_seqs * self.per_sequence[kind] + self.shared[kind] for kind in POOL_KINDS}

    @property
    def least_main_blocks(self) -> int:
        """Main-pool blocks one full-length sequence needs at its peak within a step: the
        least a budget must leave the main pool."""
        return self.per_sequence[MAIN] + self.shared[MAIN]

    @property
    def bytes_per_sequence(self) -> int:
        """Device bytes set aside for each sequence: its device pools' blocks and scratch."""
        pools = sum(self.per_sequence[kind] * self.block_bytes[kind] for kind in DEVICE_KINDS)
        return pools + self.scratch_per_sequence

    @property
    def shared_bytes(self) -> int:
        """Device bytes set aside once, whatever the number of sequences."""
        return sum(self.shared[kind] * self.block_bytes[kind] for kind in DEVICE_KINDS)

    def sequences_within(self, budget: int) -> int:
        """The most sequences whose device bytes fit in `budget` bytes (0 if none)."""
        return max(0, budget - self.shared_bytes) // self.bytes_per_sequence


@dataclass(frozen=True)
class PoolPlan:
    """Blocks of every pool (pool_kinds), bytes of one block id of each (all layers), and the
    largest prefill scratch: device bytes outside the pools."""

    limits: PoolLimits
    blocks: dict[str, int]
    block_bytes: dict[str, int]
    scratch_bytes: int

    def pool_bytes(self, kind: str) -> int:
        return self.blocks[kind] * self.block_bytes[kind]

    @property
    def device_bytes(self) -> int:
        """Bytes of the device pools' tensors (what KVCache.allocated_bytes counts)."""
        return sum(self.pool_bytes(kind) for kind in DEVICE_KINDS)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host tier's tensors (KVCache.host_allocated_bytes)."""
        return self.pool_bytes(HOST)

    @property
    def budget_bytes(self) -> int:
        """Device bytes at the peak: the pools and the prefill scratch."""
        return self.device_bytes + self.scratch_bytes


def pool_reserve(
    arch: ModelArch,
    policy: KVPolicy,
    max_model_len: int,
    step_tokens: int,
    host_tier_remote: bool = False,
) -> PoolReserve:
    """What the engine sets aside per sequence and once (the module docstring's terms)."""
    bs = policy.block_size
    per_sequence = sequence_blocks(policy, max_model_len).by_pool()
    shared = dict.fromkeys(POOL_KINDS, 0)
    step_blocks = ceil_div(step_tokens, bs)
    per_sequence[MAIN] += 1
    shared[MAIN] = step_blocks
    if policy.recent_tail:
        per_sequence[RECENT] = ceil_div(policy.recent_unquantized, bs) + 3
        shared[RECENT] = step_blocks
    scratch = 0
    if host_tier_remote:
        layers = [layer_block_bytes(arch, f.k, f.v, bs) for f in layer_formats(arch, policy)]
        largest = max(compress(layers, selecting_layers(arch, policy)), default=0)
        scratch = per_sequence[HOST] * largest
    return PoolReserve(per_sequence, shared, block_bytes(arch, policy), scratch)


def plan_pools(
    arch: ModelArch, policy: KVPolicy, limits: PoolLimits, budget: int | None = None
) -> PoolPlan:
    """Blocks of each pool for the limits: the main pool takes what `budget` device bytes leave
    (None: room for max_num_seqs full-length sequences). Refuses a budget below one
    full-length sequence. Arithmetic only, so callers run it before loading any weights."""
    reserve = pool_reserve(
        arch, policy, limits.max_model_len, limits.step_tokens, limits.host_tier_remote
    )
    blocks = reserve.blocks(limits.max_num_seqs)
    scratch = limits.max_num_seqs * reserve.scratch_per_sequence
    if budget is not None:
        sizes = reserve.block_bytes
        others = scratch + sum(blocks[kind] * sizes[kind] for kind in DEVICE_KINDS if kind != MAIN)
        blocks[MAIN] = (budget - others) // sizes[MAIN]
        if blocks[MAIN] < reserve.least_main_blocks:
            needed = reserve.least_main_blocks * sizes[MAIN] + others
            raise ConfigError(
                "kv_budget_bytes",
                budget,
                f">= {needed} bytes: one {limits.max_model_len}-token sequence under this "
                "policy (raise the budget, lower max_model_len, or quantize/compress more)",
            )
    return PoolPlan(limits, blocks, reserve.block_bytes, scratch)
