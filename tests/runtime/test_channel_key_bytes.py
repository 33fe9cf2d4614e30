"""Per-channel key scales (k_scale_axis=channel) in the shared byte arithmetic: bytes by exact
formula, and an fp16 tail block until a block is full."""

from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence, kv_bytes_per_token
from kvtune.runtime.policy import KVPolicy

SMOL = ModelArch("smol", 30, 9, 3, 64, 0, 8192)
FP16_TOKEN = 30 * 3 * 64 * 2 * 2  # K and V, 2 bytes an element: 23,040


def test_channel_scaled_keys_cost_one_scale_per_channel_per_block_and_an_fp16_tail():
    """fp4 keys with one E4M3 scale per channel per 16-token block, fp4 values with an E4M3
    scale per 16 elements; the partial last block stays fp16 until it is full."""
    policy = KVPolicy(
        k_dtype="fp4", v_dtype="fp4", group_size=16, scale_dtype="e4m3", k_scale_axis="channel"
    )
    k_block = 16 * 32 + 64 * 1  # 16 keys of 32 code bytes, 64 channel scales of 1 byte
    v_block = 16 * (32 + 4 * 1)  # 16 values of 32 code bytes and 4 group scales
    layer_block = 3 * (k_block + v_block)
    assert kv_bytes_per_token(SMOL, policy) == 30 * layer_block // 16
    # 1000 tokens: 62 full blocks quantized, the 8 tokens of block 63 in fp16.
    expected = 30 * 62 * layer_block + 16 * FP16_TOKEN
    assert kv_bytes_per_sequence(SMOL, policy, 1000) == expected
    assert kv_bytes_per_sequence(SMOL, policy, 992) == 30 * 62 * layer_block
