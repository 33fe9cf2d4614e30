"""Token-grouped scales (KIVI's per-channel keys): one scale per channel per block of tokens.

The oracle is numpy and ml_dtypes, written here from the format's definition: for each block,
head and channel, the scale comes from that channel's values over the block's tokens (symmetric:
amax / max_code rounded to the scale dtype; asymmetric: fp16 min as zero point and
(max - min) / max_code), and each element takes the nearest code. Kernel and reference must give
the same dequantized values bit for bit, the same bytes as the formula, and attention over such a
pool must equal SDPA over the oracle's values.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.attention.decode import decode_attention
from kvtune.kernels.attention.paged import PagedStream, stream_attention
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from kvtune.kernels.cache.compress import compress_blocks, compress_blocks_ref
from kvtune.kernels.cache.pool import KVPool, read_blocks_ref, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat
from tests.kernels.formats.test_zero_in_scale import oracle as zero_in_scale_oracle

BLOCK, HEADS, DIM = 16, 2, 64
TENSOR_SCALE = 0.5
FORMATS = {
    "fp4_e4m3_channel": KVFormat("fp4", 1, "e4m3", token_group=BLOCK),
    "fp8_fp16_channel": KVFormat("fp8", 1, "fp16", token_group=BLOCK),
    "int4_channel": KVFormat("int4", 1, "fp16", token_group=BLOCK),
    "int2_g2_channel": KVFormat("int2", 2, "fp16", token_group=BLOCK),
    "fp4_g16_token_pairs": KVFormat("fp4", 16, "fp16", token_group=2),
    "fp4_4over6_channel": KVFormat("fp4_4over6", 1, "e4m3", token_group=BLOCK),
    "int4_zp_in_scale_channel": KVFormat("int4_zp_in_scale", 1, "fp32", token_group=BLOCK),
}


# Group scale candidates amax / m of the symmetric formats (fp4_4over6 keeps the better one).
SCALE_CANDIDATES = {"fp8": (448.0,), "fp4": (6.0,), "fp4_4over6": (6.0, 4.0)}


def restored_symmetric(values: np.ndarray, fmt: KVFormat, max_code: float) -> np.ndarray:
    """values (one group, fp32) stored with the scale amax / max_code and read back."""
    element = ml_dtypes.float8_e4m3fn if fmt.dtype == "fp8" else ml_dtypes.float4_e2m1fn
    exact = np.float32(np.abs(values).max() / np.float32(max_code))
    scale_type = ml_dtypes.float8_e4m3fn if fmt.scale_dtype == "e4m3" else np.float16
    scale = np.float32(scale_type(exact))
    units = np.zeros_like(values) if scale == 0 else values / scale
    limit = float(ml_dtypes.finfo(element).max)
    return np.clip(units, -limit, limit).astype(element).astype(np.float32) * scale


def oracle_dequantized(x: np.ndarray, fmt: KVFormat) -> np.ndarray:
    """x [N, H, D] fp32 -> what a pool of fmt returns after storing it (numpy, per definition)."""
    t = x.astype(np.float32) / np.float32(TENSOR_SCALE)
    n, h, d = t.shape
    rows, size = fmt.token_group, fmt.group_size
    # [N/rows, rows, H, D/size, size] -> groups over (rows, size) for each (row group, H, D/size)
    blocked = t.reshape(n // rows, rows, h, d // size, size)
    out = np.empty_like(blocked)
    for b, head, g in np.ndindex(n // rows, h, d // size):
        values = blocked[b, :, head, g, :]
        if fmt.dtype == "int4_zp_in_scale":
            out[b, :, head, g, :] = zero_in_scale_oracle(values.reshape(1, -1), values.size)[
                2
            ].reshape(values.shape)
        elif fmt.dtype.startswith("int"):
            levels = 2 ** int(fmt.dtype[3:]) - 1
            zero = np.float32(np.float16(values.min()))
            scale = np.float32(np.float16(np.float32(max(values.max() - zero, 0)) / levels))
            units = np.zeros_like(values) if scale == 0 else (values - zero) / scale
            codes = np.round(np.clip(units, 0, levels))  # numpy rounds half to even
            out[b, :, head, g, :] = (codes * scale + zero) if scale else zero
        else:
            out[b, :, head, g, :] = min(
                (restored_symmetric(values, fmt, m) for m in SCALE_CANDIDATES[fmt.dtype]),
                key=lambda restored: ((restored.astype(np.float64) - values) ** 2).sum(),
            )
    return (out.reshape(n, h, d) * np.float32(TENSOR_SCALE)).astype(np.float32)


def keys_with_outlier_channels(num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Keys whose few fixed channels are 10-30x larger, as RoPE'd keys are."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, HEADS, DIM, generator=generator)
    keys[:, :, [3, 17, 40]] *= torch.tensor([10.0, -30.0, 20.0])
    return keys


def pool(fmt: KVFormat, num_blocks: int) -> KVPool:
    return KVPool.allocate(fmt, num_blocks, BLOCK, HEADS, DIM, torch.tensor([TENSOR_SCALE]))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_block_bytes_follow_the_formula_and_the_pool(name):
    fmt = FORMATS[name]
    bits = {"fp8": 8, "fp4": 4, "fp4_4over6": 4, "int4": 4, "int2": 2, "int4_zp_in_scale": 4}[
        fmt.dtype
    ]
    params = 2 if fmt.dtype in ("int4", "int2") else 1
    scale_bytes = {"e4m3": 1, "fp16": 2, "fp32": 4}[fmt.scale_dtype]
    expected = BLOCK * DIM * bits // 8 + (BLOCK // fmt.token_group) * (
        DIM // fmt.group_size * params * scale_bytes
    )
    assert fmt.block_bytes(DIM, BLOCK) == expected
    stored = pool(fmt, 3)
    allocated = stored.codes.numel() + stored.scales.numel() * stored.scales.element_size()
    assert allocated == 3 * HEADS * expected
    with pytest.raises(ValueError, match="block_bytes"):
        fmt.vector_bytes(DIM)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_whole_block_copies_store_what_the_format_defines(name):
    """fp32 blocks copied (ratio 1) into a token-grouped pool by the Triton kernel and by the
    reference: the same bytes, and the values the numpy oracle computes."""
    fmt = FORMATS[name]
    source = pool(KVFormat("fp32"), 4)
    keys = keys_with_outlier_channels(3 * BLOCK)
    write_vectors_ref(source, torch.arange(3 * BLOCK), keys)
    src_blocks = torch.tensor([0, 2, 1], dtype=torch.int32)  # blocks hold keys 0-15, 16-31, ...
    dst_blocks = [4, 0, 2]
    dst_slots = torch.tensor([b * BLOCK + i for b in dst_blocks for i in range(BLOCK)])
    by_kernel, by_reference = pool(fmt, 5), pool(fmt, 5)
    compress_blocks(source, src_blocks, by_kernel, dst_slots, ratio=1)
    compress_blocks_ref(source, src_blocks, by_reference, dst_slots, ratio=1)
    assert torch.equal(by_kernel.codes, by_reference.codes)
    assert torch.equal(by_kernel.scales, by_reference.scales)
    copied = read_vectors_ref(source, (src_blocks.long()[:, None] * BLOCK + torch.arange(BLOCK)))
    expected = oracle_dequantized(copied.flatten(0, 1).numpy(), fmt)
    stored = read_vectors_ref(by_kernel, dst_slots)
    np.testing.assert_array_equal(stored.numpy(), expected)
    table = torch.tensor([dst_blocks])
    np.testing.assert_array_equal(read_blocks_ref(by_kernel, table)[0].numpy(), expected)


def test_per_channel_scales_keep_outlier_keys_far_better_than_per_token():
    """Why the layout exists: with fixed outlier channels, per-token fp4 scales crush the other
    channels; per-channel scales keep them."""
    keys = keys_with_outlier_channels(4 * BLOCK)
    plain = [c for c in range(DIM) if c not in (3, 17, 40)]

    def error(fmt: KVFormat) -> float:
        stored = torch.from_numpy(oracle_dequantized(keys.numpy(), fmt))
        diff = (stored - keys)[:, :, plain]
        return float(diff.norm() / keys[:, :, plain].norm())

    per_token = error(KVFormat("fp4", 16, "e4m3"))
    per_channel = error(FORMATS["fp4_e4m3_channel"])
    assert per_channel < per_token / 3, (per_channel, per_token)


def test_per_token_writes_are_refused():
    from kvtune.kernels.cache.write import write_kv

    fmt = FORMATS["int4_channel"]
    k_pool, v_pool = pool(fmt, 2), pool(fmt, 2)
    vectors = torch.randn(3, HEADS, DIM)
    with pytest.raises(ValueError, match="whole block"):
        write_kv(vectors, vectors, torch.arange(3), k_pool, v_pool)
    with pytest.raises(ValueError, match="aligned runs"):
        write_vectors_ref(k_pool, torch.arange(3), vectors)
    with pytest.raises(ValueError, match="ratio"):
        compress_blocks_ref(
            pool(KVFormat("fp32"), 2), torch.tensor([0]), k_pool, torch.arange(4), ratio=4
        )


@pytest.mark.parametrize("name", ["fp4_e4m3_channel", "int4_channel"])
def test_attention_over_a_token_grouped_pool_equals_sdpa(name):
    """Keys per channel, values per token; prefill (Triton), decode (Triton) and the torch path
    against SDPA over the oracle's values."""
    fmt = FORMATS[name]
    lengths = [2 * BLOCK, 3 * BLOCK]
    keys = [keys_with_outlier_channels(n, seed=i) for i, n in enumerate(lengths)]
    values = [torch.randn(n, HEADS, DIM) for n in lengths]
    k_pool, v_pool = pool(fmt, 6), pool(KVFormat("fp8", 16), 6)
    block_ids = [[5, 1], [0, 3, 2]]
    for seq_keys, seq_values, ids in zip(keys, values, block_ids, strict=True):
        slots = torch.tensor([b * BLOCK + i for b in ids for i in range(BLOCK)])
        write_vectors_ref(k_pool, slots, seq_keys)
        write_vectors_ref(v_pool, slots, seq_values)
    table = torch.tensor([[5, 1, -1], [0, 3, 2]], dtype=torch.int32)
    stream = PagedStream(
        k_pool,
        v_pool,
        table,
        torch.tensor(lengths, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )
    q = torch.randn(2, 6, DIM)
    scale = DIM**-0.5
    decode_out, _ = decode_attention(q, stream, scale)
    positions = torch.tensor([n - 1 for n in lengths], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill_out, _ = stream_attention(q, positions, starts, stream, scale)
    torch_out = cache_attention_torch(q, positions, starts, [stream], scale)
    for seq in range(2):
        k = torch.from_numpy(oracle_dequantized(keys[seq].numpy(), fmt))
        v = read_vectors_ref(
            v_pool,
            table[seq, : lengths[seq] // BLOCK].long().repeat_interleave(BLOCK) * BLOCK
            + torch.arange(lengths[seq]) % BLOCK,
        )
        expected = F.scaled_dot_product_attention(
            q[seq][None, :, None, :],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
        for out in (decode_out, prefill_out, torch_out):
            error = float((out[seq] - expected).norm() / expected.norm())
            assert error <= 1e-5 and not math.isnan(error)
