"""Scheduling with real block accounting and a stand-in for the model's next token."""

import pytest

from kvtune.runtime.block_manager import BlockManager
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import sequence_blocks
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from kvtune.runtime.scheduler import Scheduler
from kvtune.runtime.sequence import RequestMetrics, Sequence, SequenceStatus


def make_seq(seq_id: int, prompt_len: int, max_new: int = 4) -> Sequence:
    return Sequence(seq_id, list(range(prompt_len)), max_new, 0.0, RequestMetrics(arrival=seq_id))


def run(scheduler: Scheduler, max_steps: int = 2000) -> list[list[tuple[int, int]]]:
    """Drive the scheduler like the engine does; returns each step's (seq_id, tokens)."""
    steps = []
    while scheduler.has_work:
        batch = scheduler.schedule()
        assert batch, "nothing scheduled while work is queued"
        for item in batch:
            seq = item.seq
            assert len(item.slots) == item.num_tokens
            seq.num_cached += item.num_tokens
            kv = scheduler.kv[seq.seq_id]
            scheduler.blocks.release(scheduler.blocks.maintain(kv), [kv])
            expected = sequence_blocks(scheduler.blocks.policy, seq.num_cached)
            assert scheduler.blocks.held(kv)[MAIN] == expected.quantized + expected.summary
            if seq.num_cached == seq.num_tokens:
                seq.append_token(7)
                if seq.should_stop(max_model_len=10_000):
                    scheduler.finish(seq)
        steps.append([(i.seq.seq_id, i.num_tokens) for i in batch])
        assert len(steps) < max_steps
    return steps


def test_fcfs_admits_in_arrival_order_and_chunks_prefill_at_block_boundaries():
    policy = KVPolicy(block_size=16, chunk_size=64)
    scheduler = Scheduler(BlockManager(policy, 100, 0), max_num_seqs=1, max_num_batched_tokens=64)
    for seq_id, length in enumerate([150, 10, 40]):
        scheduler.add(make_seq(seq_id, length))
    steps = run(scheduler)
    assert steps[:3] == [[(0, 64)], [(0, 64)], [(0, 22)]]
    order = [step[0][0] for step in steps]
    assert order == sorted(order)  # one at a time, in arrival order


def test_budget_cuts_chunks_to_whole_blocks():
    policy = KVPolicy(block_size=16, chunk_size=64)
    scheduler = Scheduler(BlockManager(policy, 100, 0), max_num_seqs=4, max_num_batched_tokens=70)
    scheduler.add(make_seq(0, 10))
    scheduler.add(make_seq(1, 200))
    first = scheduler.schedule()
    assert [(i.seq.seq_id, i.num_tokens) for i in first] == [(0, 10), (1, 48)]


def test_length_aware_runs_short_prompts_first():
    policy = KVPolicy(block_size=16, chunk_size=64)
    scheduler = Scheduler(
        BlockManager(policy, 100, 0),
        max_num_seqs=1,
        max_num_batched_tokens=64,
        policy="length_aware",
    )
    for seq_id, length in enumerate([300, 20, 5, 60]):
        scheduler.add(make_seq(seq_id, length))
    steps = run(scheduler)
    first_seen = list(dict.fromkeys(step[0][0] for step in steps))
    assert first_seen == [2, 1, 3, 0]


def test_length_aware_does_not_starve_a_long_prompt():
    policy = KVPolicy(block_size=16, chunk_size=64)
    scheduler = Scheduler(
        BlockManager(policy, 100, 0),
        max_num_seqs=1,
        max_num_batched_tokens=64,
        policy="length_aware",
        starvation_steps=10,
    )
    long_prompt = make_seq(0, 500)
    scheduler.add(long_prompt)
    next_id = 1
    for _ in range(100):  # a steady stream of short requests
        scheduler.add(make_seq(next_id, 8, max_new=2))
        next_id += 1
        for item in scheduler.schedule():
            item.seq.num_cached += item.num_tokens
            if item.seq.num_cached == item.seq.num_tokens:
                item.seq.append_token(7)
                if item.seq.should_stop(10_000):
                    scheduler.finish(item.seq)
        if long_prompt.status is not SequenceStatus.WAITING:
            break
    assert long_prompt.status is not SequenceStatus.WAITING
    assert long_prompt.metrics.arrival == 0


def test_preemption_by_recompute_when_blocks_run_out():
    policy = KVPolicy(block_size=16, chunk_size=64)
    # 8 blocks = 128 token slots; three sequences growing to 60 tokens each cannot all fit.
    scheduler = Scheduler(BlockManager(policy, 8, 0), max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [make_seq(i, 20, max_new=40) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    run(scheduler)
    assert scheduler.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and len(s.output_ids) == 40 for s in seqs)
    assert scheduler.blocks.pools[MAIN].num_free == 8


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="scheduling='sjf'"):
        Scheduler(BlockManager(KVPolicy(), 10, 0), 1, 64, policy="sjf")
