"""Paged-stream attention: Triton kernels vs torch references vs one SDPA on dense tensors.

Vectors are written to shuffled pool blocks, unused slots hold NaN (or NaN scale codes), and the
SDPA oracle sees each sequence's dense vectors after a quantize-dequantize round trip, never the
pools, so gather, masking and in-kernel dequantization are all checked independently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.attention.decode import decode_attention, decode_attention_ref
from kvtune.kernels.attention.merge import merge_attention, merge_attention_ref
from kvtune.kernels.attention.paged import PagedStream, stream_attention, stream_attention_ref
from kvtune.kernels.cache.pool import KVPool, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref

FORMATS = {
    "fp32": KVFormat("fp32"),
    "fp16": KVFormat("fp16"),
    "bf16": KVFormat("bf16"),
    "fp8": KVFormat("fp8"),
    "fp8_g16": KVFormat("fp8", 16),
    "fp8_g32": KVFormat("fp8", 32),
    "fp4": KVFormat("fp4"),
    "fp4_g16_e4m3": KVFormat("fp4", 16, "e4m3"),
    "fp4_g32": KVFormat("fp4", 32),
    "fp4_4over6_g16_e4m3": KVFormat("fp4_4over6", 16, "e4m3"),
    "int4_zp_in_scale_g64": KVFormat("int4_zp_in_scale", 64, "fp32"),
    "int8_g64": KVFormat("int8", 64),
    "int4_g32": KVFormat("int4", 32),
    "int4_g128": KVFormat("int4", 128),
    "int2_g16": KVFormat("int2", 16),
    "int2_g32": KVFormat("int2", 32),
    "int3_g32": KVFormat("int3", 32),
    "lloyd4_g64": KVFormat("lloyd4", 64),
    "lloyd3_g128": KVFormat("lloyd3", 128),
    "int3_tq_g64": KVFormat("int3_tq", 64),
    "int4_tq_g32": KVFormat("int4_tq", 32),
}
E4M3_NAN = 0x7F
TOLERANCE = 1e-5


@dataclass
class StreamCase:
    """A paged stream and, per sequence, the dense dequantized vectors it must hold."""

    stream: PagedStream
    keys: list[torch.Tensor]  # [L, Hkv, D] fp32
    values: list[torch.Tensor]
    key_positions: list[torch.Tensor]  # [L] causal position of each vector


def _tensor_scale(fmt: KVFormat) -> torch.Tensor:
    """A tensor scale other than 1 for quantized formats, so that it is exercised."""
    return torch.tensor([0.5 if fmt.quantized else 1.0])


def _stored_values(dense: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """What a pool of fmt returns for dense vectors [N, H, D]: their quantize-dequantize."""
    codes, scales = quantize_ref(dense, fmt, _tensor_scale(fmt))
    return dequantize_ref(codes, scales, fmt, _tensor_scale(fmt), dense.shape[-1])


def _poisoned_pool(fmt: KVFormat, num_blocks: int, block_size: int, heads: int, dim: int) -> KVPool:
    """A pool whose every slot decodes to NaN (fp4 per-tensor codes cannot: they decode to 6)."""
    pool = KVPool.allocate(fmt, num_blocks, block_size, heads, dim, _tensor_scale(fmt))
    pool.codes.fill_(math.nan if not fmt.quantized else (E4M3_NAN if fmt.dtype == "fp8" else 0x77))
    if pool.scales is not None:
        pool.scales.fill_(E4M3_NAN if fmt.scale_dtype == "e4m3" else math.nan)
    return pool


def build_stream(
    lengths: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
    start_positions: list[int] | None = None,
    position_stride: int = 1,
    logit_bias: float = 0.0,
    dense: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    seed: int = 0,
) -> StreamCase:
    """Random (or given dense) vectors written to shuffled pool blocks of one stream."""
    generator = torch.Generator().manual_seed(seed)
    starts = start_positions or [0] * len(lengths)
    blocks_per_seq = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_table = torch.full((len(lengths), max(blocks_per_seq, default=0) + 1), -1)
    block_table = block_table.to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_pool, v_pool = _poisoned_pool(k_fmt, *shape), _poisoned_pool(v_fmt, *shape)
    keys, values, positions = [], [], []
    used = 0
    for seq, length in enumerate(lengths):
        ids = block_ids[used : used + blocks_per_seq[seq]]
        used += blocks_per_seq[seq]
        block_table[seq, : len(ids)] = ids
        if dense is None:
            k = torch.randn(length, num_kv_heads, head_dim, generator=generator)
            v = torch.randn(length, num_kv_heads, head_dim, generator=generator)
        else:
            k, v = dense[0][seq], dense[1][seq]
        index = torch.arange(length)
        slots = ids.long()[index // block_size] * block_size + index % block_size
        write_vectors_ref(k_pool, slots, k)
        write_vectors_ref(v_pool, slots, v)
        keys.append(_stored_values(k, k_fmt))
        values.append(_stored_values(v, v_fmt))
        positions.append(starts[seq] + index * position_stride + position_stride - 1)
    stream = PagedStream(
        k=k_pool,
        v=v_pool,
        block_table=block_table,
        lengths=torch.tensor(lengths, dtype=torch.int32),
        start_positions=torch.tensor(starts, dtype=torch.int32),
        position_stride=position_stride,
        logit_bias=logit_bias,
    )
    return StreamCase(stream, keys, values, positions)


def sdpa_oracle(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    key_bias: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA of q [T, Hq, D] over dense keys [L, Hkv, D] with an additive bias/causal mask.

    Returns out [T, Hq, D] and which query rows see at least one key (SDPA gives NaN for the
    others).
    """
    visible = torch.ones(len(q), len(keys), dtype=torch.bool)
    if q_positions is not None:
        visible = key_positions[None, :] <= q_positions[:, None].long()
    mask = torch.where(visible, key_bias[None, :], -math.inf)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(),
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1), visible.any(dim=1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_close(actual: tuple, expected: tuple) -> None:
    """Outputs within TOLERANCE relative error; LSEs equal, -inf where expected."""
    (out, lse), (ref_out, ref_lse) = actual, expected
    assert not out.isnan().any() and not lse.isnan().any()
    assert relative_error(out, ref_out) <= TOLERANCE
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    finite = ref_lse > -math.inf
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=TOLERANCE, atol=TOLERANCE)


def assert_matches_sdpa(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    cases: list[StreamCase],
    scale: float,
) -> None:
    """Merged result of several streams == one SDPA over their concatenated dense keys."""
    for seq in range(len(q_seq_starts) - 1):
        begin, end = int(q_seq_starts[seq]), int(q_seq_starts[seq + 1])
        keys = torch.cat([case.keys[seq] for case in cases])
        values = torch.cat([case.values[seq] for case in cases])
        key_positions = torch.cat([case.key_positions[seq] for case in cases])
        key_bias = torch.cat(
            [torch.full((len(case.keys[seq]),), case.stream.logit_bias) for case in cases]
        )
        positions = None if q_positions is None else q_positions[begin:end]
        expected, has_keys = sdpa_oracle(
            q[begin:end], positions, keys, values, key_positions, key_bias, scale
        )
        seq_out, seq_lse = out[begin:end], lse[begin:end]
        if has_keys.any():
            assert relative_error(seq_out[has_keys], expected[has_keys]) <= TOLERANCE
        assert torch.all(seq_out[~has_keys] == 0)
        assert torch.all(seq_lse[~has_keys] == -math.inf)
        assert torch.all(seq_lse[has_keys] > -math.inf)


def extend_queries(
    q_lens: list[int], case: StreamCase, num_q_heads: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed queries of the last q_len positions of each sequence's keys (an extend chunk),
    stepping back past the first key so that some queries see nothing."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = case.stream.head_dim
    positions = [
        torch.arange(q_len) + int(case.key_positions[seq][-1]) + 1 - q_len
        if len(case.key_positions[seq])
        else torch.arange(q_len)
        for seq, q_len in enumerate(q_lens)
    ]
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=generator)
    q_seq_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, torch.cat(positions).to(torch.int32), q_seq_starts


# (head_dim, num_kv_heads, GQA group, block_size, K format, V format)
SHAPES = [
    (64, 2, 1, 16, "fp32", "fp32"),
    (128, 1, 3, 8, "fp16", "bf16"),
    (64, 1, 7, 32, "fp8", "fp32"),
    (128, 2, 8, 16, "fp8_g16", "fp4_g32"),
    (64, 2, 4, 8, "fp4_g16_e4m3", "fp8_g16"),
    (128, 4, 1, 32, "fp4", "fp16"),
    (96, 1, 3, 16, "bf16", "fp8_g32"),
    (64, 2, 4, 16, "int4_g32", "int2_g16"),
    (128, 1, 3, 8, "int8_g64", "int4_g128"),
    (96, 2, 2, 16, "int2_g32", "fp4_g32"),
    (128, 2, 4, 16, "fp4_4over6_g16_e4m3", "fp4_4over6_g16_e4m3"),
    (64, 2, 3, 16, "int4_zp_in_scale_g64", "int4_zp_in_scale_g64"),
    (64, 2, 4, 16, "lloyd4_g64", "int3_tq_g64"),
    (128, 1, 3, 8, "lloyd3_g128", "int3_g32"),
    (96, 2, 2, 16, "int3_g32", "int4_tq_g32"),
]
LENGTHS = [0, 1, 37, 150, 8]
SPLITS = [1, 3, 8, 2, 5, 4, 16, 3, 7, 2, 4, 3, 5, 2, 3]  # decode splits, one per shape


@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,k_name,v_name", SHAPES)
def test_stream_attention_matches_reference_and_sdpa(
    head_dim, num_kv_heads, group, block_size, k_name, v_name
):
    case = build_stream(
        LENGTHS,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        k_fmt=FORMATS[k_name],
        v_fmt=FORMATS[v_name],
        start_positions=[3, 0, 5, 0, 100],
    )
    q, q_positions, q_seq_starts = extend_queries([2, 1, 5, 9, 3], case, num_kv_heads * group)
    q_positions[-1] = 99  # before the stream's first key: sees nothing
    scale = head_dim**-0.5
    result = stream_attention(q, q_positions, q_seq_starts, case.stream, scale)
    reference = stream_attention_ref(q, q_positions, q_seq_starts, case.stream, scale)
    assert_close(result, reference)
    assert_matches_sdpa(*result, q, q_positions, q_seq_starts, [case], scale)
    assert_matches_sdpa(*reference, q, q_positions, q_seq_starts, [case], scale)


@pytest.mark.parametrize(
    "head_dim,num_kv_heads,group,block_size,k_name,v_name,num_splits",
    [(*shape, splits) for shape, splits in zip(SHAPES, SPLITS, strict=True)],
)
def test_decode_attention_matches_reference_and_sdpa(
    head_dim, num_kv_heads, group, block_size, k_name, v_name, num_splits
):
    case = build_stream(
        [0, 1, 29, 70, 130],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        k_fmt=FORMATS[k_name],
        v_fmt=FORMATS[v_name],
    )
    q = torch.randn(5, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(2))
    q_seq_starts = torch.arange(6, dtype=torch.int32)
    scale = head_dim**-0.5
    result = decode_attention(q, case.stream, scale, num_splits=num_splits)
    reference = decode_attention_ref(q, case.stream, scale)
    assert_close(result, reference)
    assert_matches_sdpa(*result, q, None, q_seq_starts, [case], scale)
    assert_matches_sdpa(*reference, q, None, q_seq_starts, [case], scale)


@pytest.mark.slow
def test_decode_default_splits_and_strided_queries():
    """A query slice of a fused QKV tensor (row stride > Hq * D) with the default split count."""
    case = build_stream(
        [40, 3],
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        k_fmt=FORMATS["fp32"],
        v_fmt=FORMATS["fp32"],
    )
    qkv = torch.randn(2, 3 * 4 * 64)
    q = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not q.is_contiguous()
    result = decode_attention(q, case.stream, 0.125)
    assert_close(result, decode_attention_ref(q, case.stream, 0.125))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries(dtype):
    """fp16 / bf16 queries are read as they are (upcast once), for prefill and decode."""
    case = build_stream(
        [19, 33],
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        k_fmt=FORMATS["bf16"],
        v_fmt=FORMATS["fp16"],
    )
    q, q_positions, q_seq_starts = extend_queries([4, 6], case, 4)
    q = q.to(dtype)
    assert_close(
        stream_attention(q, q_positions, q_seq_starts, case.stream, 0.125, max_q_len=6),
        stream_attention_ref(q, q_positions, q_seq_starts, case.stream, 0.125),
    )
    assert_close(
        decode_attention(q[:2], case.stream, 0.125, num_splits=2),
        decode_attention_ref(q[:2], case.stream, 0.125),
    )


def test_summary_stream_matches_sdpa_with_bias():
    """Summaries of r = 4 tokens: visible from the group's last position, logits + ln 4."""
    ratio = 4
    case = build_stream(
        [0, 3, 9],
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        k_fmt=FORMATS["fp32"],
        v_fmt=FORMATS["fp32"],
        start_positions=[16, 16, 4],
        position_stride=ratio,
        logit_bias=math.log(ratio),
    )
    # Queries inside, at the end of, and before summary groups, and after all of them.
    q_positions = torch.tensor([20, 27, 28, 31, 40, 3, 6, 7, 21, 39, 60], dtype=torch.int32)
    q_seq_starts = torch.tensor([0, 1, 5, 11], dtype=torch.int32)
    q = torch.randn(11, 6, 64, generator=torch.Generator().manual_seed(3))
    scale = 0.125
    result = stream_attention(q, q_positions, q_seq_starts, case.stream, scale)
    assert_close(result, stream_attention_ref(q, q_positions, q_seq_starts, case.stream, scale))
    assert_matches_sdpa(*result, q, q_positions, q_seq_starts, [case], scale)


def test_summary_bias_gives_a_group_of_identical_keys_its_mass():
    """r identical tokens as exact keys == one summary of them with stride r and bias ln r."""
    ratio, groups = 4, 5
    generator = torch.Generator().manual_seed(4)
    k = torch.randn(groups, 2, 64, generator=generator)
    v = torch.randn(groups, 2, 64, generator=generator)
    fmt = FORMATS["fp32"]
    common = {"num_kv_heads": 2, "head_dim": 64, "block_size": 8, "k_fmt": fmt, "v_fmt": fmt}
    exact = build_stream(
        [groups * ratio],
        **common,
        dense=([k.repeat_interleave(ratio, 0)], [v.repeat_interleave(ratio, 0)]),
    )
    summary = build_stream(
        [groups], **common, position_stride=ratio, logit_bias=math.log(ratio), dense=([k], [v])
    )
    q = torch.randn(3, 4, 64, generator=generator)
    q_positions = torch.tensor([3, 11, 19], dtype=torch.int32)  # ends of groups 0, 2, 4
    q_seq_starts = torch.tensor([0, 3], dtype=torch.int32)
    assert_close(
        stream_attention(q, q_positions, q_seq_starts, summary.stream, 0.125),
        stream_attention(q, q_positions, q_seq_starts, exact.stream, 0.125),
    )
    assert_close(
        decode_attention(q[:1], summary.stream, 0.125, num_splits=2),
        decode_attention(q[:1], exact.stream, 0.125, num_splits=3),
    )


def csa_streams(totals: list[int], formats: dict[str, str]) -> list[StreamCase]:
    """Sinks (4) + summaries (r = 4) + older window + recent window streams of CSA sequences.

    Token t < 4 is a sink; the window keeps the last 13 tokens, of which the last 5 are the
    recent (fp16-style) part; the compressed middle holds whole groups of 4 tokens.
    """
    sinks, ratio, window, recent = 4, 4, 13, 5
    common = {"num_kv_heads": 2, "head_dim": 64, "block_size": 8}
    layout = []
    for total in totals:
        n_sinks = min(sinks, total)
        n_summaries = max(0, total - sinks - window) // ratio
        window_start = n_sinks + n_summaries * ratio
        recent_start = max(window_start, total - recent)
        layout.append((n_sinks, n_summaries, window_start, recent_start, total))

    def stream(name, lengths, starts, seed, **extra):
        fmt = FORMATS[formats[name]]
        return build_stream(
            lengths, **common, k_fmt=fmt, v_fmt=fmt, start_positions=starts, seed=seed, **extra
        )

    return [
        stream("sinks", [row[0] for row in layout], [0] * len(totals), 10),
        stream(
            "summaries",
            [row[1] for row in layout],
            [row[0] for row in layout],
            11,
            position_stride=ratio,
            logit_bias=math.log(ratio),
        ),
        stream("window", [r[3] - r[2] for r in layout], [r[2] for r in layout], 12),
        stream("recent", [r[4] - r[3] for r in layout], [r[3] for r in layout], 13),
    ]


CSA_FORMATS = [
    {"sinks": "fp32", "summaries": "fp32", "window": "fp32", "recent": "fp32"},
    {"sinks": "fp16", "summaries": "fp4_g16_e4m3", "window": "fp8_g16", "recent": "fp16"},
]


@pytest.mark.parametrize("formats", CSA_FORMATS, ids=["fp32", "mixed"])
def test_csa_composition_matches_one_sdpa(formats):
    """Per-stream partials merged by LSE == one SDPA over all dequantized keys with bias."""
    totals = [3, 20, 61]
    cases = csa_streams(totals, formats)
    generator = torch.Generator().manual_seed(5)
    q_lens = [3, 6, 8]
    q = torch.randn(sum(q_lens), 6, 64, generator=generator)
    q_positions = torch.cat(
        [torch.arange(total - q_len, total) for total, q_len in zip(totals, q_lens, strict=True)]
    ).to(torch.int32)
    q_seq_starts = torch.tensor([0, 3, 9, 17], dtype=torch.int32)
    partials = [
        stream_attention(q, q_positions, q_seq_starts, case.stream, 0.125) for case in cases
    ]
    merged = merge_attention(partials)
    assert_close(merged, merge_attention_ref(partials))
    assert_matches_sdpa(*merged, q, q_positions, q_seq_starts, cases, 0.125)

    q_decode = torch.randn(3, 6, 64, generator=generator)
    decode_partials = [decode_attention(q_decode, case.stream, 0.125, 2) for case in cases]
    merged = merge_attention(decode_partials)
    assert_matches_sdpa(*merged, q_decode, None, torch.arange(4, dtype=torch.int32), cases, 0.125)


def test_invalid_streams_raise():
    case = build_stream(
        [5],
        num_kv_heads=1,
        head_dim=64,
        block_size=8,
        k_fmt=FORMATS["fp32"],
        v_fmt=FORMATS["fp32"],
    )
    stream = case.stream
    with pytest.raises(ValueError, match="block_table.dtype"):
        PagedStream(
            stream.k, stream.v, stream.block_table.long(), stream.lengths, stream.start_positions
        )
    with pytest.raises(ValueError, match="position_stride"):
        PagedStream(
            stream.k,
            stream.v,
            stream.block_table,
            stream.lengths,
            stream.start_positions,
            position_stride=0,
        )
    with pytest.raises(ValueError, match="num_q_heads"):
        decode_attention(torch.randn(1, 3, 64), _with_heads(stream, 2), 0.125)


def _with_heads(stream: PagedStream, heads: int) -> PagedStream:
    """The same stream layout with `heads` KV heads (zero pools)."""
    shape = (*stream.k.codes.shape[:2], heads, stream.head_dim)
    pools = [KVPool(torch.zeros(shape), None, pool.fmt) for pool in (stream.k, stream.v)]
    return PagedStream(*pools, stream.block_table, stream.lengths, stream.start_positions)
