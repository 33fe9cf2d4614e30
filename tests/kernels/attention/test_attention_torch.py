"""The torch backend's whole-cache attention equals the per-sequence references (themselves
checked against SDPA in test_attention.py), merged by log-sum-exp over several streams."""

import dataclasses
import math

import pytest
import torch

from kvtune.kernels.attention.decode import decode_attention_ref
from kvtune.kernels.attention.merge import merge_attention_ref
from kvtune.kernels.attention.paged import stream_attention_ref
from kvtune.kernels.attention.paged_torch import cache_attention_torch, merge_decode_streams
from tests.kernels.attention.test_attention import (
    CSA_FORMATS,
    FORMATS,
    LENGTHS,
    SHAPES,
    TOLERANCE,
    build_stream,
    csa_streams,
    extend_queries,
    relative_error,
)


@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,k_name,v_name", SHAPES)
@pytest.mark.parametrize("summary", [False, True])
def test_batched_torch_attention_matches_reference(
    head_dim, num_kv_heads, group, block_size, k_name, v_name, summary
):
    case = build_stream(
        LENGTHS,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        k_fmt=FORMATS[k_name],
        v_fmt=FORMATS[v_name],
        start_positions=[3, 0, 5, 0, 100],
        position_stride=4 if summary else 1,
        logit_bias=1.386 if summary else 0.0,
    )
    q, q_positions, q_seq_starts = extend_queries([2, 1, 5, 9, 3], case, num_kv_heads * group)
    q_positions[-1] = 99  # before the stream's first key: sees nothing
    scale = head_dim**-0.5
    expected, expected_lse = stream_attention_ref(q, q_positions, q_seq_starts, case.stream, scale)
    result = cache_attention_torch(q, q_positions, q_seq_starts, [case.stream], scale)
    assert relative_error(result, expected) <= TOLERANCE
    assert torch.all(result[expected_lse == -math.inf] == 0)  # the query that sees nothing
    decode_q = q[: len(LENGTHS)]
    expected, _ = decode_attention_ref(decode_q, case.stream, scale)
    seq_starts = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    result = cache_attention_torch(decode_q, None, seq_starts, [case.stream], scale)
    assert relative_error(result, expected) <= TOLERANCE


@pytest.mark.parametrize("formats", CSA_FORMATS, ids=["fp32", "mixed"])
def test_whole_cache_attention_equals_the_merged_streams(formats):
    """One SDPA over sinks, summaries (biased), window and recent == per-stream references
    merged by log-sum-exp, for prefill queries (one sees nothing) and decode."""
    totals = [3, 20, 61, 0]
    cases = csa_streams(totals, formats)
    streams = [case.stream for case in cases]
    generator = torch.Generator().manual_seed(7)
    q_lens = [3, 6, 8, 2]
    q = torch.randn(sum(q_lens), 6, 64, generator=generator)
    q_positions = torch.cat(
        [torch.arange(total - n, total) for total, n in zip(totals, q_lens, strict=True)]
    ).to(torch.int32)
    q_seq_starts = torch.tensor([0, 3, 9, 17, 19], dtype=torch.int32)
    expected, _ = merge_attention_ref(
        [stream_attention_ref(q, q_positions, q_seq_starts, s, 0.125) for s in streams]
    )
    actual = cache_attention_torch(q, q_positions, q_seq_starts, streams, 0.125)
    assert relative_error(actual, expected) <= TOLERANCE
    assert torch.all(actual[17:] == 0)  # an empty cache: no key to see

    q_decode = torch.randn(4, 6, 64, generator=generator)
    expected, _ = merge_attention_ref([decode_attention_ref(q_decode, s, 0.125) for s in streams])
    seq_starts = torch.arange(5, dtype=torch.int32)
    actual = cache_attention_torch(q_decode, None, seq_starts, streams, 0.125)
    assert relative_error(actual, expected) <= TOLERANCE


def test_decode_reads_streams_of_shared_pools_as_one():
    """Streams in one pair of pools (whole blocks, partial last blocks, empty for some
    sequences, a gap inside a block) are read by decode in fewer gathers, with the result of
    attending each stream apart and merging by log-sum-exp; a stream with another logit bias
    stays apart."""
    block_size = 8
    whole = build_stream(
        [40, 7, 64, 23],
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        k_fmt=FORMATS["int4_g32"],
        v_fmt=FORMATS["int8_g64"],
    ).stream
    # Per stream, per sequence: (first block, blocks, length).
    splits = {
        "whole blocks": [(0, 2, 16), (0, 0, 0), (0, 4, 32), (0, 1, 8)],
        "partial with a gap": [(2, 1, 5), (0, 0, 0), (4, 1, 8), (1, 1, 6)],
        "partial tail": [(3, 2, 16), (0, 1, 7), (5, 3, 20), (2, 1, 7)],
    }
    streams = [_sub_stream(whole, split, 0.0) for split in splits.values()]
    streams.append(_sub_stream(whole, [(0, 1, 3), (0, 1, 2), (7, 1, 8), (0, 0, 0)], 0.7))
    assert len(merge_decode_streams(streams)) == 3  # whole + one partial, a partial, the biased
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(3))
    expected, _ = merge_attention_ref([decode_attention_ref(q, s, 0.125) for s in streams])
    seq_starts = torch.arange(5, dtype=torch.int32)
    actual = cache_attention_torch(q, None, seq_starts, streams, 0.125)
    assert relative_error(actual, expected) <= TOLERANCE


def _sub_stream(whole, split: list[tuple[int, int, int]], logit_bias: float):
    """Some blocks of each sequence of `whole` as a stream of their own."""
    width = max(blocks for _, blocks, _ in split) + 1
    table = torch.full((len(split), width), -1, dtype=torch.int32)
    for seq, (first, blocks, _) in enumerate(split):
        table[seq, :blocks] = whole.block_table[seq, first : first + blocks]
    lengths = torch.tensor([length for _, _, length in split], dtype=torch.int32)
    return dataclasses.replace(whole, block_table=table, lengths=lengths, logit_bias=logit_bias)
