"""The engine's pools: sizes against byte sums worked out by hand (DESIGN.md section 1), the
tensors the runtime allocates against the plan, and max_num_seqs full-length sequences run in
the planned pools without preemption."""

from __future__ import annotations

import pytest

from kvtune.runtime import LLM
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.host_fetch import HostFetch
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, POOL_KINDS, RECENT, STAGE
from kvtune.runtime.pool_plan import PoolLimits, plan_pools
from tests.runtime.test_engine import random_tokens

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
SMOL = ModelArch("smol", 30, 9, 3, 64, 0, 8192)
FP16_BLOCK = 16 * 30 * 3 * 64 * 2 * 2  # 16 tokens, every layer, K and V of 2-byte elements
STEP_BLOCKS = 512 // 16  # the default chunk_size, in blocks of 16


def test_plain_fp16_sets_aside_one_block_a_sequence_and_a_steps_blocks():
    """1000 tokens are 63 blocks of 16; 4 sequences: 4 x (63 + 1) + 32 main blocks."""
    plan = plan_pools(SMOL, KVPolicy(), PoolLimits(4, 1000, 512))
    assert plan.blocks == {MAIN: 4 * 64 + 32, RECENT: 0, INDEX: 0, STAGE: 0, HOST: 0}
    assert plan.device_bytes == (4 * 64 + 32) * FP16_BLOCK
    assert plan.scratch_bytes == plan.host_bytes == 0
    # Beyond 4 sequences' own bytes: the named slack, nothing else.
    slack = plan.budget_bytes - 4 * kv_bytes_per_sequence(SMOL, KVPolicy(), 1000)
    assert slack == (4 + STEP_BLOCKS) * FP16_BLOCK


def test_a_budget_gives_the_main_pool_what_the_other_pools_leave():
    limits = PoolLimits(4, 1000, 512)
    plan = plan_pools(SMOL, KVPolicy(), limits, budget=200 * FP16_BLOCK + FP16_BLOCK - 1)
    assert plan.blocks[MAIN] == 200
    # One sequence at its peak: 63 blocks + 1 + a step's 32.
    assert plan_pools(SMOL, KVPolicy(), limits, budget=96 * FP16_BLOCK).blocks[MAIN] == 96
    with pytest.raises(ConfigError, match=f">= {96 * FP16_BLOCK} bytes"):
        plan_pools(SMOL, KVPolicy(), limits, budget=96 * FP16_BLOCK - 1)


def test_an_fp16_recent_tail_reserves_its_region_for_each_sequence_and_a_step_once():
    """fp4 keys with a scale per channel over each 16-token block (E4M3), fp4 values with an
    E4M3 scale per 16 elements, the last 100 tokens in fp16. At 1000 tokens those touch blocks
    56..62: 56 quantized blocks, 7 fp16. The engine keeps ceil(100 / 16) + 3 = 10 fp16 blocks a
    sequence and a step's 32 once."""
    policy = KVPolicy(
        "fp4",
        "fp4",
        group_size=16,
        scale_dtype="e4m3",
        k_scale_axis="channel",
        recent_unquantized=100,
    )
    quantized_block = 30 * 3 * ((16 * 32 + 64) + 16 * (32 + 4))
    plan = plan_pools(SMOL, policy, PoolLimits(2, 1000, 512))
    assert plan.blocks[MAIN] == 2 * (56 + 1) + STEP_BLOCKS
    assert plan.blocks[RECENT] == 2 * 10 + STEP_BLOCKS
    assert kv_bytes_per_sequence(SMOL, policy, 1000) == 56 * quantized_block + 7 * FP16_BLOCK
    slack = plan.budget_bytes - 2 * kv_bytes_per_sequence(SMOL, policy, 1000)
    main_slack = (2 + STEP_BLOCKS) * quantized_block
    assert slack == main_slack + (2 * (10 - 7) + STEP_BLOCKS) * FP16_BLOCK


SELECTING = KVPolicy(
    "fp8", "fp8", csa_ratio=16, csa_window=256, csa_sinks=16, csa_topk=32, csa_host=True
)
# fp8 g32: 64 code bytes and 2 fp16 scales a vector; a block of one layer: 16 x 3 x 2 x 68 B.
FP8_LAYER_BLOCK = 16 * 3 * 2 * 68


@pytest.mark.parametrize("staging", ["resident", "streamed"])
def test_selection_pools_and_the_prefill_scratch_of_a_host_tier_off_the_device(staging):
    """2048 tokens: 1 sink block, 16 window blocks, 111 pooled blocks (7 blocks of summaries,
    7 of key bounds, 111 in the host tier), 32 staging blocks. Beside a GPU a prefill step
    copies one layer's host blocks of every sequence to the device: 111 x one layer's block a
    sequence."""
    policy = SELECTING.replace(csa_staging=staging)
    streamed = staging == "streamed"
    limits = PoolLimits(2, 2048, 512, host_tier_remote=True)
    plan = plan_pools(SMOL, policy, limits)
    block = 30 * FP8_LAYER_BLOCK
    main = 1 + 16 + 7 + (0 if streamed else 32)
    assert plan.blocks[MAIN] == 2 * (main + 1) + STEP_BLOCKS
    assert plan.blocks[INDEX] == 2 * 7 and plan.blocks[HOST] == 2 * 111
    assert plan.blocks[STAGE] == (2 * 32 if streamed else 0)
    assert plan.host_bytes == 2 * 111 * block
    # A streamed pool holds one layer's blocks: every layer has one format.
    stage = 2 * 32 * FP8_LAYER_BLOCK if streamed else 0
    assert plan.device_bytes == (2 * (main + 1) + STEP_BLOCKS + 2 * 7) * block + stage
    assert plan.scratch_bytes == 2 * 111 * FP8_LAYER_BLOCK
    slack = plan.budget_bytes - 2 * kv_bytes_per_sequence(SMOL, policy, 2048)
    assert slack == (2 + STEP_BLOCKS) * block + 2 * 111 * FP8_LAYER_BLOCK
    on_cpu = plan_pools(SMOL, policy, PoolLimits(2, 2048, 512))
    assert on_cpu.scratch_bytes == 0 and on_cpu.device_bytes == plan.device_bytes


def test_the_scratch_follows_the_largest_selecting_layer():
    """Ten fp16 layers (16 x 3 x 2 x 128 B a block) beside twenty fp8 ones; with the fp16
    layers' budget 0 they keep no host copies and the fp8 layers set the scratch."""
    mixed = SELECTING.replace(layer_dtypes=("fp16/fp16",) * 10 + ("fp8/fp8",) * 20)
    limits = PoolLimits(1, 2048, 512, host_tier_remote=True)
    assert plan_pools(SMOL, mixed, limits).scratch_bytes == 111 * 16 * 3 * 2 * 128
    quiet = mixed.replace(csa_topk=0, layer_csa_topk=(0,) * 10 + (32,) * 20)
    assert plan_pools(SMOL, quiet, limits).scratch_bytes == 111 * FP8_LAYER_BLOCK


# Policies whose pools differ in kind (on the tiny model: 2 layers, 2 KV heads, head_dim 32).
TINY_SELECTING = KVPolicy(
    "fp8",
    "fp8",
    group_size=16,
    csa_ratio=4,
    csa_window=16,
    csa_sinks=4,
    csa_topk=2,
    csa_host=True,
    block_size=8,
    chunk_size=16,
)
POLICIES = {
    "fp16": KVPolicy("fp16", "fp16", block_size=8, chunk_size=16),
    "fp8 per tensor": KVPolicy("fp8", "fp8", group_size="tensor", block_size=8, chunk_size=16),
    "int4 channel keys, recent": KVPolicy(
        "int4",
        "int4",
        group_size=16,
        k_scale_axis="channel",
        recent_unquantized=12,
        block_size=8,
        chunk_size=24,
    ),
    "summaries": KVPolicy(
        "fp8",
        "fp4",
        group_size=16,
        csa_ratio=2,
        csa_window=24,
        csa_sinks=8,
        recent_unquantized=12,
        block_size=8,
        chunk_size=24,
    ),
    "selection, resident": TINY_SELECTING,
    "selection, streamed, two formats": TINY_SELECTING.replace(
        layer_dtypes=("fp8/fp8", "int4/int4"), csa_staging="streamed"
    ),
    "int4 index": TINY_SELECTING.replace(
        k_dtype="int4",
        v_dtype="int4",
        k_scale_axis="channel",
        csa_summary="none",
        csa_index_dtype="int4",
        rotation="hadamard",
    ),
    "int4 means index": TINY_SELECTING.replace(
        csa_summary="none", csa_index="means", csa_index_dtype="int4"
    ),
    "one layer selects": TINY_SELECTING.replace(csa_topk=0, layer_csa_topk=(0, 3)),
    "csa_keep": KVPolicy(
        "fp8",
        "fp8",
        group_size=16,
        csa_ratio=4,
        csa_window=64,
        csa_sinks=4,
        csa_keep=0.25,
        recent_unquantized=8,
        block_size=8,
        chunk_size=24,
    ),
}


@pytest.mark.parametrize("name", POLICIES)
def test_the_allocated_tensors_are_the_planned_pools(tiny_llama, name):
    """KVCache's tensors (codes and scales, summed) take the plan's bytes, with the engine's
    default budget and with one of its own (then the main pool takes the rest in blocks)."""
    policy = POLICIES[name]
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=96, max_num_seqs=3)
    engine = llm.engine
    assert engine.pools == plan_pools(llm.arch, policy, PoolLimits(3, 96, policy.chunk_size))
    for kind in POOL_KINDS:
        assert engine.blocks.pools[kind].num_blocks == engine.pools.blocks[kind]
    assert engine.cache.allocated_bytes == engine.pools.device_bytes
    assert engine.cache.host_allocated_bytes == engine.pools.host_bytes
    assert (engine.pools.host_bytes > 0) == policy.selects
    budget = engine.pools.device_bytes + 5 * engine.pools.block_bytes[MAIN] + 1
    budgeted = LLM(
        str(tiny_llama), policy, max_model_len=96, max_num_seqs=3, kv_budget_bytes=budget
    )
    pools = budgeted.engine.pools
    assert pools.blocks[MAIN] == engine.pools.blocks[MAIN] + 5
    assert budgeted.engine.cache.allocated_bytes == pools.device_bytes == budget - 1


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICIES)
def test_max_num_seqs_full_length_sequences_run_together_in_the_planned_pools(tiny_llama, name):
    """The plan's slack is enough: six sequences prefilled in the same steps, then decoded
    together up to max_model_len, are never preempted."""
    policy = POLICIES[name]
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=96, max_num_seqs=6)
    lengths = [40 + 3 * seed for seed in range(6)]
    prompts = [random_tokens(n, seed=seed) for seed, n in enumerate(lengths)]
    results = llm.generate(prompts, max_new_tokens=96)
    assert [len(r.token_ids) for r in results] == [96 - n for n in lengths]
    assert llm.stats()["preemptions"] == 0


def test_a_prefill_from_a_host_tier_off_the_device_copies_at_most_the_planned_scratch(
    tiny_llama, monkeypatch
):
    """Forced on the CPU (the host tier is then read as if it were off the device): two
    64-token prompts prefilled in one step hold (64 - 4 sinks - 16 window) // 8 = 5 host
    blocks each, and each layer copies those 10 blocks: the scratch of two sequences, within
    the three the engine plans for."""
    policy = TINY_SELECTING.replace(chunk_size=64)
    llm = LLM(str(tiny_llama), policy, max_model_len=64, max_num_seqs=3, max_num_batched_tokens=128)
    scratch_bytes = []
    fetch_for_prefill = HostFetch.fetch_for_prefill

    def recording(self, layer, host):
        scratch = fetch_for_prefill(self, layer, host)
        tensors = [t for pool in (scratch.k, scratch.v) for t in (pool.codes, pool.scales)]
        scratch_bytes.append(sum(t.nbytes for t in tensors if t is not None))
        return scratch

    monkeypatch.setattr(HostFetch, "host_is_remote", lambda self, host: True)
    monkeypatch.setattr(HostFetch, "fetch_for_prefill", recording)
    llm.generate([random_tokens(64, seed=1), random_tokens(64, seed=2)], max_new_tokens=0)
    # fp8 in groups of 16 with fp16 scales: 32 code bytes and 2 scales a vector of 32.
    layer_block = 8 * 2 * 2 * (32 + 2 * 2)
    assert scratch_bytes == [2 * 5 * layer_block] * llm.arch.num_layers
    for sequences in (2, 3):
        limits = PoolLimits(sequences, 64, 128, host_tier_remote=True)
        planned = plan_pools(llm.arch, policy, limits).scratch_bytes
        assert planned == sequences * 5 * layer_block
