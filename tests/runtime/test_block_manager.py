"""The block manager holds exactly the blocks the shared byte arithmetic predicts."""

import random

import pytest

from kvtune.runtime.block_manager import BlockManager
from kvtune.runtime.kv_bytes import sequence_blocks
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN, RECENT

POLICIES = [
    KVPolicy(),
    KVPolicy(block_size=8, chunk_size=64),
    KVPolicy(k_dtype="fp4", recent_unquantized=40, block_size=16, chunk_size=64),
    KVPolicy(csa_ratio=4, csa_window=64, csa_sinks=16, block_size=16, chunk_size=64),
    KVPolicy(csa_ratio=2, csa_window=32, csa_sinks=5, block_size=8, chunk_size=32),
    KVPolicy(
        k_dtype="fp8",
        csa_ratio=8,
        csa_window=48,
        csa_sinks=4,
        recent_unquantized=20,
        block_size=16,
        chunk_size=32,
    ),
    KVPolicy(csa_ratio=4, csa_window=32, csa_sinks=0, recent_unquantized=100, block_size=16),
    # Demoted and pooled within one chunk (recent region shorter than the window).
    KVPolicy(
        k_dtype="fp4",
        csa_ratio=4,
        csa_window=48,
        csa_sinks=3,
        recent_unquantized=16,
        block_size=16,
        chunk_size=128,
    ),
]


def run_steps(manager: BlockManager, steps: list[int]):
    kv = manager.new_sequence()
    for num_new in steps:
        assert manager.can_append(kv, num_new)
        before_free = {k: p.num_free for k, p in manager.pools.items()}
        need = manager.needs(kv, num_new)
        manager.append(kv, num_new)
        # As the engine does: maintain up to the chunk's last position before the attention,
        # release, then maintain up to every token. At each peak (copies written, sources not
        # yet freed) the step stays within `needs`.
        copies = []
        for upto in (kv.num_tokens - 1, kv.num_tokens):
            stage = manager.maintain(kv, upto)
            assert before_free[MAIN] - manager.pools[MAIN].num_free <= need.main
            assert before_free[RECENT] - manager.pools[RECENT].num_free <= need.recent
            manager.release(stage, [kv])
            copies += stage
        yield kv, copies


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_held_blocks_equal_the_planner_after_every_step(policy, seed):
    rng = random.Random(seed)
    manager = BlockManager(policy, num_main_blocks=400, num_recent_blocks=100)
    chunks = [policy.chunk_size] * rng.randint(0, 3) + [rng.randint(1, policy.chunk_size)]
    steps = chunks + [1] * rng.randint(50, 150)
    for kv, _ in run_steps(manager, steps):
        expected = sequence_blocks(policy, kv.num_tokens)
        held = manager.held(kv)
        assert held[MAIN] == expected.quantized + expected.summary
        assert held[RECENT] == expected.recent
    manager.free(kv)
    assert manager.pools[MAIN].num_free == 400
    assert manager.pools[RECENT].num_free == 100


def test_compression_pools_whole_blocks_into_summary_slots():
    policy = KVPolicy(csa_ratio=4, csa_window=32, csa_sinks=8, block_size=16, chunk_size=64)
    manager = BlockManager(policy, num_main_blocks=50, num_recent_blocks=0)
    [(kv, copies)] = list(run_steps(manager, [64]))
    # 64 tokens: 8 sinks, 56 after them; (56 - 32) // 16 = 1 block leaves the window.
    assert len(copies) == 1
    [copy] = copies
    assert copy.ratio == 4 and len(copy.dst_slots) == 4
    assert kv.window.start == 8 + 16 and kv.num_summaries == 4
    assert copy.dst_slots == tuple(kv.summary_blocks[0] * 16 + i for i in range(4))


def test_blocks_leave_the_recent_pool_once_old():
    policy = KVPolicy(k_dtype="fp8", recent_unquantized=16, block_size=16, chunk_size=64)
    manager = BlockManager(policy, num_main_blocks=20, num_recent_blocks=10)
    [(kv, copies)] = list(run_steps(manager, [64]))
    # 64 tokens = 4 blocks; only the last one holds any of the 16 most recent tokens.
    assert [c.ratio for c in copies] == [1, 1, 1]
    assert [b.kind for b in kv.window.blocks] == [MAIN, MAIN, MAIN, RECENT]
    assert manager.pools[RECENT].num_used == 1


def test_needs_refuses_more_than_the_pool_holds():
    manager = BlockManager(KVPolicy(), num_main_blocks=3, num_recent_blocks=0)
    kv = manager.new_sequence()
    assert manager.can_append(kv, 48)
    assert not manager.can_append(kv, 49)
