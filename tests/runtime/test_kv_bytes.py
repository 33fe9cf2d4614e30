"""Byte arithmetic against sums worked out by hand from DESIGN.md section 1."""

import pytest

from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_bytes import (
    SequenceBlocks,
    host_kv_bytes_per_sequence,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    max_fetch_bytes_per_step,
    sequence_blocks,
)
from kvtune.runtime.policy import KVPolicy

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64.
SMOL = ModelArch("smol", 30, 9, 3, 64, 0, 8192)
# DeepSeek V3: 61 layers caching a 512 + 64 element latent.
DSV3 = ModelArch("dsv3", 61, 128, 128, 192, 0, 163840, kv_lora_rank=512, qk_rope_head_dim=64)
FP16_TOKEN = 30 * 3 * 64 * 2 * 2  # K and V, 2 bytes an element: 23,040


def test_dense_fp16_rounds_up_to_whole_blocks():
    assert kv_bytes_per_token(SMOL, KVPolicy()) == 23040
    # 1000 tokens in blocks of 16: 63 blocks hold 1008 token slots.
    assert kv_bytes_per_sequence(SMOL, KVPolicy(), 1000) == 1008 * 23040
    assert kv_bytes_per_sequence(SMOL, KVPolicy(block_size=64), 1000) == 1024 * 23040
    assert kv_bytes_per_sequence(SMOL, KVPolicy(), 17) == 32 * 23040
    assert kv_bytes_per_sequence(SMOL, KVPolicy(), 0) == 0


def test_the_design_example_llama_61_layers():
    arch = ModelArch("example", 61, 64, 8, 128, 0, 131072)
    assert kv_bytes_per_token(arch, KVPolicy()) == 249856
    assert kv_bytes_per_sequence(arch, KVPolicy(), 131072) == 32749125632


def test_fp8_per_tensor_has_no_per_token_scales():
    policy = KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size="tensor")
    assert kv_bytes_per_token(SMOL, policy) == 30 * 3 * 64 * 2  # 11,520


@pytest.mark.parametrize(("scale_dtype", "scale_bytes"), [("e4m3", 1), ("fp16", 2)])
def test_fp4_group16_counts_packed_codes_and_scales(scale_dtype, scale_bytes):
    policy = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size=16, scale_dtype=scale_dtype)
    vector = 64 // 2 + (64 // 16) * scale_bytes  # 32 code bytes + 4 scales
    assert kv_bytes_per_token(SMOL, policy) == 30 * 3 * 2 * vector


@pytest.mark.parametrize(("dtype", "bits"), [("int8", 8), ("int4", 4), ("int2", 2)])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_integer_formats_count_codes_scales_and_zero_points(dtype, bits, group):
    policy = KVPolicy(k_dtype=dtype, v_dtype=dtype, group_size=group)
    # 64 elements of `bits` bits, then an fp16 scale and an fp16 zero point per group.
    vector = 64 * bits // 8 + (64 // group) * (2 + 2)
    assert kv_bytes_per_token(SMOL, policy) == 30 * 3 * 2 * vector
    assert kv_bytes_per_sequence(SMOL, policy, 1000) == 1008 * 30 * 3 * 2 * vector


def test_rotation_costs_no_bytes():
    policy = KVPolicy(k_dtype="int4", v_dtype="fp8", group_size=32, recent_unquantized=64)
    rotated = policy.replace(rotation="hadamard")
    k_vector, v_vector = 32 + 2 * 4, 64 + 2 * 2
    assert kv_bytes_per_token(SMOL, rotated) == 30 * 3 * (k_vector + v_vector)
    # 1000 tokens: the last 64 (936..999) touch blocks 58..62; 58 blocks quantized.
    expected = 16 * (58 * 30 * 3 * (k_vector + v_vector) + 5 * FP16_TOKEN)
    assert kv_bytes_per_sequence(SMOL, rotated, 1000) == expected
    assert kv_bytes_per_sequence(SMOL, policy, 1000) == expected


def test_mixed_k_and_v_and_per_layer_overrides():
    policy = KVPolicy(k_dtype="fp8", v_dtype="fp4", group_size=32, scale_dtype="fp16")
    k_vector, v_vector = 64 + 2 * 2, 32 + 2 * 2
    assert kv_bytes_per_token(SMOL, policy) == 30 * 3 * (k_vector + v_vector)
    layers = ("fp16/fp16",) * 10 + ("fp8/fp4",) * 20
    mixed = policy.replace(layer_dtypes=layers)
    expected = 10 * 3 * 64 * 2 * 2 + 20 * 3 * (k_vector + v_vector)
    assert kv_bytes_per_token(SMOL, mixed) == expected


def test_auto_uses_the_models_compute_dtype():
    fp32_model = ModelArch("smol32", 30, 9, 3, 64, 0, 8192, dtype="fp32")
    assert (
        kv_bytes_per_token(fp32_model, KVPolicy(k_dtype="auto", v_dtype="auto")) == 2 * FP16_TOKEN
    )


@pytest.mark.parametrize(
    ("tokens", "sink_blocks", "window_blocks", "summary_blocks"),
    [
        (300, 1, 18, 0),  # inside the window: 16 sinks + 284 window tokens
        (543, 1, 33, 0),  # 527 after the sinks: one token short of a whole block past W
        (544, 1, 32, 1),  # one block (16 tokens) pooled into 4 summaries
        (2000, 1, 32, 23),  # 92 blocks pooled: 1472 tokens -> 368 summaries -> 23 blocks
        (10, 1, 0, 0),  # shorter than the sinks
    ],
)
def test_csa_streams_at_lengths_inside_and_past_the_window(
    tokens, sink_blocks, window_blocks, summary_blocks
):
    policy = KVPolicy(csa_ratio=4, csa_sinks=16, csa_window=512, block_size=16)
    blocks = sequence_blocks(policy, tokens)
    assert blocks.quantized == sink_blocks + window_blocks
    assert blocks.summary == summary_blocks
    assert blocks.recent == 0
    expected = (sink_blocks + window_blocks + summary_blocks) * 16 * FP16_TOKEN
    assert kv_bytes_per_sequence(SMOL, policy, tokens) == expected


def test_csa_with_unaligned_sinks_keeps_them_in_their_own_block():
    policy = KVPolicy(csa_ratio=2, csa_sinks=4, csa_window=64, block_size=16)
    # 200 tokens: 4 sinks (1 block); 196 after them; (196 - 64) // 16 = 8 blocks pooled
    # (128 tokens -> 64 summaries = 4 blocks); window keeps 68 tokens = 5 blocks.
    assert sequence_blocks(policy, 200).total == 1 + 5 + 4


def test_recent_tokens_stay_fp16_block_by_block():
    policy = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size=16, recent_unquantized=100)
    quantized_token = 30 * 3 * 2 * (32 + 4 * 2)
    # 1000 tokens = 63 blocks; the last 100 tokens (900..999) touch blocks 56..62.
    blocks = sequence_blocks(policy, 1000)
    assert (blocks.quantized, blocks.recent) == (56, 7)
    assert kv_bytes_per_sequence(SMOL, policy, 1000) == 16 * (56 * quantized_token + 7 * FP16_TOKEN)
    # Shorter than the recent region: everything stays fp16.
    assert kv_bytes_per_sequence(SMOL, policy, 50) == 64 * FP16_TOKEN


def test_recent_region_with_compression_covers_sinks_only_when_they_are_recent():
    policy = KVPolicy(
        k_dtype="fp8",
        v_dtype="fp8",
        group_size="tensor",
        recent_unquantized=32,
        csa_ratio=4,
        csa_sinks=16,
        csa_window=64,
        block_size=16,
    )
    # 40 tokens: the sink block (0..15) holds token 8..15 of the last 32 -> fp16;
    # the window (16..39) is 2 blocks, both recent.
    assert sequence_blocks(policy, 40) == SequenceBlocks(quantized=0, recent=3, summary=0)
    # 200 tokens: sinks old; window keeps 184 - (184 - 64) // 16 * 16 = 72 tokens in 5
    # blocks starting at 128: blocks 128..143, .., 192..199; last 32 tokens 168..199
    # touch the blocks starting at 160, 176 and 192.
    blocks = sequence_blocks(policy, 200)
    assert (blocks.quantized, blocks.recent, blocks.summary) == (1 + 2, 3, 2)


def test_mla_caches_one_latent_a_token_and_layer():
    assert kv_bytes_per_token(DSV3, KVPolicy()) == 61 * 576 * 2
    fp8 = KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size="tensor")
    assert kv_bytes_per_token(DSV3, fp8) == 61 * 576
    fp4 = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size=64, scale_dtype="e4m3")
    assert kv_bytes_per_token(DSV3, fp4) == 61 * (288 + 9)
    assert kv_bytes_per_sequence(DSV3, KVPolicy(), 4096) == 4096 * 61 * 576 * 2


def test_importance_keeping_counts_its_kept_blocks_from_each_groups_first_pooled_block():
    """fp8 g32 (6,528 B a block of one layer, 195,840 B all layers, as below), CSA 16:1 over
    16 sinks and a 256-token window, csa_keep 0.25: 2 kept blocks for every group of 8 pooled
    blocks, held from the moment the group's first block is pooled."""
    policy = KVPolicy("fp8", "fp8", csa_ratio=16, csa_window=256, csa_sinks=16, csa_keep=0.25)
    block = 16 * 3 * 2 * 68 * 30
    pooled = (2048 - 16 - 256) // 16  # 111 blocks: 14 groups, the last one open
    kept = 2 * 14
    assert kv_bytes_per_sequence(SMOL, policy, 2048) == (1 + 16 + 7 + kept) * block
    assert pooled == 111
    # The first pooled block opens a group: 2 kept blocks at once.
    assert kv_bytes_per_sequence(SMOL, policy, 16 + 256 + 16) == (1 + 16 + 1 + 2) * block
    assert host_kv_bytes_per_sequence(SMOL, policy, 2048) == 0


def test_selection_counts_staging_and_bounds_on_the_device_and_the_pooled_blocks_on_the_host():
    """fp8 g32, blocks of 16, CSA 16:1 over 16 sinks and a 256-token window, top 32 from the host
    tier, 2048 tokens. A vector: 64 code bytes + 2 fp16 scales = 68 B; a block of one layer:
    16 tokens x 3 heads x (K + V) x 68 = 6,528 B; all 30 layers: 195,840 B."""
    policy = KVPolicy(
        "fp8", "fp8", csa_ratio=16, csa_window=256, csa_sinks=16, csa_topk=32, csa_host=True
    )
    block = 16 * 3 * 2 * 68 * 30
    pooled = (2048 - 16 - 256) // 16  # 111 blocks left the window
    # Device: 1 sink block, 16 window blocks, 111 summaries (7 blocks), 111 bound slots (7
    # blocks), 32 staging blocks.
    device = (1 + 16 + 7 + 7 + 32) * block
    assert pooled == 111
    assert kv_bytes_per_sequence(SMOL, policy, 2048) == device
    assert host_kv_bytes_per_sequence(SMOL, policy, 2048) == pooled * block
    assert max_fetch_bytes_per_step(SMOL, policy, 2048) == 32 * block
    # Scored on summaries instead: no bound slots.
    summaries = policy.replace(csa_index="summaries")
    assert kv_bytes_per_sequence(SMOL, summaries, 2048) == device - 7 * block
    # Without summaries: no summary blocks, the host tier and fetches unchanged.
    quest = policy.replace(csa_summary="none")
    assert kv_bytes_per_sequence(SMOL, quest, 2048) == device - 7 * block
    assert host_kv_bytes_per_sequence(SMOL, quest, 2048) == pooled * block
    # Bounds in a separate int4 index: a vector of 64 channels is 32 code bytes + 2 groups of
    # 32 x (fp16 scale + fp16 zero point) = 40 B, a block of bound slots of one layer
    # 16 x 3 x 2 x 40 = 3,840 B (in place of 6,528 B in the layers' fp8).
    int4_index = quest.replace(csa_index_dtype="int4")
    index_block = 16 * 3 * 2 * (32 + 2 * 4) * 30
    assert kv_bytes_per_sequence(SMOL, int4_index, 2048) == device - 14 * block + 7 * index_block
    fp16_index = quest.replace(csa_index_dtype="fp16")
    index_block = 16 * 3 * 2 * 128 * 30
    assert kv_bytes_per_sequence(SMOL, fp16_index, 2048) == device - 14 * block + 7 * index_block
    # Mean keys instead of bounds: one K vector a slot, no V half (16 x 3 x 128 B a layer).
    means_index = fp16_index.replace(csa_index="means")
    means_block = 16 * 3 * 128 * 30
    assert kv_bytes_per_sequence(SMOL, means_index, 2048) == device - 14 * block + 7 * means_block
    # In the layers' fp8: 16 x 3 x 68 B a layer of slots.
    in_layer = quest.replace(csa_index="means")
    assert kv_bytes_per_sequence(SMOL, in_layer, 2048) == device - 7 * block - 7 * block // 2
    # Before any block leaves the window: no host tier, no staging, no bounds.
    assert host_kv_bytes_per_sequence(SMOL, policy, 272) == 0
    assert kv_bytes_per_sequence(SMOL, policy, 272) == 17 * block


def test_a_streamed_staging_pool_costs_one_block_of_each_distinct_layer_format():
    """The selecting fp8 policy above with csa_staging=streamed: its 32 staging blocks are one
    pool that the layers fill in turn, so they cost 32 blocks of one layer (6,528 B each), not
    of all 30; every decode step fetches all of them in every layer."""
    policy = KVPolicy(
        "fp8",
        "fp8",
        csa_ratio=16,
        csa_window=256,
        csa_sinks=16,
        csa_topk=32,
        csa_host=True,
        csa_staging="streamed",
    )
    layer_block = 16 * 3 * 2 * 68
    resident_device = (1 + 16 + 7 + 7) * 30 * layer_block
    assert kv_bytes_per_sequence(SMOL, policy, 2048) == resident_device + 32 * layer_block
    assert host_kv_bytes_per_sequence(SMOL, policy, 2048) == 111 * 30 * layer_block
    assert max_fetch_bytes_per_step(SMOL, policy, 2048) == 32 * 30 * layer_block
    # Two formats (the first 10 layers fp16, so their blocks are 16 x 3 x 2 x 128 B): a pool
    # of each, 32 blocks apiece.
    mixed = policy.replace(layer_dtypes=("fp16/fp16",) * 10 + ("fp8/fp8",) * 20)
    fp16_block = 16 * 3 * 2 * 128
    mixed_resident = (1 + 16 + 7 + 7) * (10 * fp16_block + 20 * layer_block)
    expected = mixed_resident + 32 * (fp16_block + layer_block)
    assert kv_bytes_per_sequence(SMOL, mixed, 2048) == expected
    # Per-layer budgets share the pool, sized by the largest: 48 in the last 10 layers, 16 in
    # the other 20 (one of them 0) fetch (10 x 48 + 19 x 16) layer blocks a step. The layer
    # with budget 0 keeps neither its 7 index blocks nor host copies.
    pyramid = policy.replace(csa_topk=0, layer_csa_topk=(0,) + (16,) * 19 + (48,) * 10)
    pyramid_device = resident_device - 7 * layer_block + 48 * layer_block
    assert kv_bytes_per_sequence(SMOL, pyramid, 2048) == pyramid_device
    assert host_kv_bytes_per_sequence(SMOL, pyramid, 2048) == 111 * 29 * layer_block
    assert max_fetch_bytes_per_step(SMOL, pyramid, 2048) == (10 * 48 + 19 * 16) * layer_block
    # At 400 tokens (16 sinks, 256 window) 8 blocks are older: no layer fetches more.
    assert max_fetch_bytes_per_step(SMOL, pyramid, 400) == 29 * 8 * layer_block
