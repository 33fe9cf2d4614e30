"""The capacity planner: per-sequence bytes by the DESIGN.md section 1 formula, and sequences
that fit counted with exactly what kvtune's engine sets aside for them."""

from __future__ import annotations

import pytest

from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.autotune.planning.capacity import build_plan, capacity_row
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from kvtune.runtime.pool_plan import PoolLimits, plan_pools

# SmolLM2-135M's cache (30 layers, 3 KV heads, head_dim 64) with no weights on a 1 GiB card.
SMOL = ModelArch("smol", 30, 9, 3, 64, 0, 8192)
CARD = DeviceSpec("card", 1.0, 100.0)
SERVE = ServeSettings(max_model_len=1000, gpu_memory_utilization=1.0, activation_reserve_gib=0)


@pytest.mark.parametrize(
    ("policy", "vector_bytes"),
    [
        (KVPolicy(), 64 * 2),  # fp16: 2 bytes an element
        (KVPolicy("fp8", "fp8", group_size="tensor"), 64),  # one scale for the whole tensor
        (KVPolicy("fp8", "fp8", group_size=32), 64 + 2 * 2),  # an fp16 scale a group of 32
        (KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"), 32 + 4 * 1),
        (KVPolicy("int4", "int4", group_size=32), 32 + 2 * (2 + 2)),  # scale and zero point
    ],
)
def test_plain_policies_plan_the_design_formula_per_sequence(policy, vector_bytes):
    """layers x KV heads x (K + V vector bytes) a token, 1000 tokens in 63 blocks of 16."""
    row = build_plan(SMOL, policy, CARD, SERVE).chosen
    assert row.kv_bytes_per_token == 30 * 3 * 2 * vector_bytes
    assert row.kv_bytes_per_sequence == 30 * 3 * 2 * vector_bytes * 63 * 16


def test_the_engine_reserve_is_one_block_a_sequence_and_a_steps_blocks_once():
    """fp16, 1000 tokens: a sequence is 63 blocks; kvtune's engine adds 1 block a sequence and
    a 512-token step's 32 blocks once, so 1 GiB holds 45 sequences where the bytes of the
    sequences alone would hold 46."""
    block = 16 * 30 * 3 * 64 * 2 * 2
    row = build_plan(SMOL, KVPolicy(), CARD, SERVE).chosen
    assert (row.reserve_bytes_per_sequence, row.reserve_bytes_shared) == (block, 32 * block)
    assert row.max_num_seqs == (GIB - 32 * block) // (64 * block) == 45
    assert GIB // (63 * block) == 46
    # Another engine's format counts its sequences' bytes alone.
    other = capacity_row("vllm", SMOL, KVPolicy(), CARD, SERVE, GIB)
    assert (other.max_num_seqs, other.reserve_bytes_per_sequence) == (46, 0)
    plan = build_plan(SMOL, KVPolicy(), CARD, SERVE).to_dict()
    assert plan["headroom_bytes"] == GIB - 45 * 64 * block - 32 * block


SELECTING = KVPolicy(
    "fp8", "fp8", csa_ratio=16, csa_window=256, csa_sinks=16, csa_topk=32, csa_host=True
)
POLICIES = [
    KVPolicy(),
    KVPolicy("fp4", "fp4", group_size=16, k_scale_axis="channel", recent_unquantized=100),
    KVPolicy("fp8", "fp4", csa_ratio=4, csa_window=256, recent_unquantized=64),
    SELECTING,
    SELECTING.replace(csa_staging="streamed", layer_dtypes=("fp16/fp16",) * 10 + ("fp8/fp8",) * 20),
    SELECTING.replace(csa_summary="none", csa_index="means", csa_index_dtype="int4"),
    KVPolicy("fp8", "fp8", csa_ratio=4, csa_window=256, csa_keep=0.25),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("context", [1000, 4096])
def test_the_planner_counts_what_the_engine_allocates(policy, context):
    """The plan's max_num_seqs is the most sequences whose pools (and prefill scratch, the host
    tier being off the GPU) the engine would fit in the budget, and it allocates exactly the
    bytes the planner counts for them."""
    serve = ServeSettings(max_model_len=context, gpu_memory_utilization=1.0)
    plan = build_plan(SMOL, policy, DeviceSpec("card", 4.0, 100.0), serve)
    row = plan.chosen
    assert row.max_num_seqs > 0

    def engine_bytes(sequences: int) -> int:
        limits = PoolLimits(sequences, context, policy.chunk_size, host_tier_remote=True)
        return plan_pools(SMOL, policy, limits).budget_bytes

    assert row.allocated_bytes(row.max_num_seqs) == engine_bytes(row.max_num_seqs)
    assert engine_bytes(row.max_num_seqs) <= plan.kv_budget_bytes
    assert engine_bytes(row.max_num_seqs + 1) > plan.kv_budget_bytes
    assert plan.to_dict()["headroom_bytes"] == plan.kv_budget_bytes - engine_bytes(row.max_num_seqs)
    # The engine given that budget takes it whole, within a main-pool block.
    limits = PoolLimits(row.max_num_seqs, context, policy.chunk_size, host_tier_remote=True)
    budgeted = plan_pools(SMOL, policy, limits, plan.kv_budget_bytes)
    assert 0 <= plan.kv_budget_bytes - budgeted.budget_bytes < budgeted.block_bytes[MAIN]
