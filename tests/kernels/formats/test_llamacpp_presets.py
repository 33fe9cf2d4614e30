"""The llama.cpp presets (conf/policy/llamacpp/<type>.yaml) store what llama-server stores with
`--cache-type-k <type> --cache-type-v <type>`, and mixed K/V as the element formats of K and V.

Each preset is composed by Hydra as `policy=llamacpp/<type>` selects it; K and V are rotated
as the runtime rotates them (the layer's `kv_rotation`) and written into paged pools by the
Triton cache write and the torch reference. The pools' codes and scales, as ggml's block bytes,
equal the numpy port of llama.cpp (tests/kernels/formats/llamacpp_formats_ref.py): its rotation
(`llama_mul_mat_hadamard` on the CPU) of the quantized streams, then its quantize; f16 and bf16
are the values converted (gguf-py's F16 / BF16 conversion). Bytes per token follow ggml's block
sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvtune.autotune.config.engine_presets import POLICY_DIR
from kvtune.kernels.cache.pool import KVPool
from kvtune.kernels.cache.write import write_kv, write_kv_ref
from kvtune.kernels.formats.ggml_blocks import to_ggml_blocks
from kvtune.kernels.formats.rotation import kv_rotation, rotate
from tests.kernels.formats import llamacpp_formats_ref as ref
from tests.kernels.formats.test_engine_presets import preset_policy

TYPES = sorted(path.stem for path in (POLICY_DIR / "llamacpp").glob("*.yaml"))
BLOCK, NUM_BLOCKS, HEADS, TOKENS = 16, 4, 2, 40
UNQUANTIZED = {"f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}
# K / V type pairs llama-server takes: the presets, and mixed pairs by one override.
MIXED = [("q8_0", "q4_0"), ("f16", "q4_0"), ("q4_1", "f16"), ("q5_0", "iq4_nl")]
PAIRS = [(t, t) for t in TYPES] + MIXED


def test_every_accepted_type_but_f32_has_a_preset():
    """f32 is left out: kvtune's policy names no fp32 cache (auto is the model's dtype)."""
    assert sorted(set(ref.KV_CACHE_TYPES) - {"f32"}) == TYPES


def pair_policy(k_type: str, v_type: str, head_dim: int):
    """policy=llamacpp/<k_type>, with V's element format from <v_type>'s preset when it differs
    (as `policy=llamacpp/q8_0 policy.v_dtype=q4_0` composes it)."""
    overrides = [f"model.head_dim={head_dim}"]
    if v_type != k_type:
        v_dtype = preset_policy(f"llamacpp/{v_type}").v_dtype
        overrides.append(f"policy.v_dtype={v_dtype}")
    return preset_policy(f"llamacpp/{k_type}", *overrides)


def llamacpp_stores(x: np.ndarray, ggml_type: str, rotation_block: int) -> np.ndarray:
    """What llama.cpp's CPU keeps of fp32 vectors x [..., head_dim] in a cache of ggml_type:
    rotated (where rotation_block > 0), then quantized or converted, as bytes."""
    if rotation_block:
        x = ref.mul_mat_hadamard(x, rotation_block)
    if ggml_type in UNQUANTIZED:
        flat = quants.quantize(x.reshape(-1, x.shape[-1]), UNQUANTIZED[ggml_type])
        return flat.view(np.uint8).reshape(*x.shape[:-1], -1)
    return ref.quantize_row(x, ggml_type)


def pool_bytes(pool: KVPool, slots: torch.Tensor, ggml_type: str) -> np.ndarray:
    """The vectors at slots as llama.cpp's bytes: ggml blocks, or the values' own bytes."""
    codes = pool.codes.flatten(0, 1)[slots.long()].contiguous()
    if pool.scales is None:
        return codes.view(torch.uint8).numpy()
    scales = pool.scales.flatten(0, 1)[slots.long()]
    return to_ggml_blocks(codes, scales, ggml_type).numpy()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("k_type", "v_type"), PAIRS, ids=[f"{k}-{v}" for k, v in PAIRS])
def test_preset_stores_llama_servers_bytes(k_type, v_type, head_dim):
    policy = pair_policy(k_type, v_type, head_dim)
    fmt_k = policy.kv_format(policy.k_dtype, "bf16", keys=True)
    fmt_v = policy.kv_format(policy.v_dtype, "bf16")
    rotation = kv_rotation(policy.rotation, head_dim, 0, (fmt_k.quantized, fmt_v.quantized))
    blocks = ref.rotation_blocks(head_dim, fmt_k.quantized, fmt_v.quantized)
    rng = np.random.default_rng(head_dim)
    k, v = (rng.standard_normal((TOKENS, HEADS, head_dim)).astype(np.float32) for _ in range(2))
    k[:, :, 3] *= 30.0  # an outlier channel, as RoPE'd keys have
    cached = [
        torch.from_numpy(x) if r is None else rotate(torch.from_numpy(x), r)
        for x, r in ((k, rotation.keys), (v, rotation.values))
    ]
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(2))[:TOKENS]
    for write in (write_kv, write_kv_ref):
        pools = [KVPool.allocate(f, NUM_BLOCKS, BLOCK, HEADS, head_dim) for f in (fmt_k, fmt_v)]
        write(*cached, slots, *pools)
        for pool, x, ggml_type, block in zip(pools, (k, v), (k_type, v_type), blocks, strict=True):
            expected = llamacpp_stores(x, ggml_type, block)
            np.testing.assert_array_equal(pool_bytes(pool, slots, ggml_type), expected)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_preset_bytes_per_token_head_are_ggmls(ggml_type):
    for head_dim in (64, 128):
        policy = pair_policy(ggml_type, ggml_type, head_dim)
        fmt_k = policy.kv_format(policy.k_dtype, "bf16", keys=True)
        fmt_v = policy.kv_format(policy.v_dtype, "bf16")
        expected = 2 * ref.stream_bytes(ggml_type, head_dim)
        assert fmt_k.vector_bytes(head_dim) + fmt_v.vector_bytes(head_dim) == expected
        per_block = fmt_k.block_bytes(head_dim, BLOCK) + fmt_v.block_bytes(head_dim, BLOCK)
        assert per_block == BLOCK * expected
        assert policy.tensor_scale == "unit" and policy.rotation == "llamacpp"
