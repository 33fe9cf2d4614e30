"""Stream lifetimes: a vector is shown only to positions in [block end + shown_from, block end +
hidden_from), on the Triton kernel, its reference and the torch backend alike.

The oracle is one SDPA over the dense vectors with a mask built here from the definition: the
stream's positions are cut into blocks of block_size tokens, a vector belongs to the block that
holds its first token, and that block ends where its last stored token ends.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.attention.paged import stream_attention, stream_attention_ref
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from tests.kernels.attention.test_attention import FORMATS, build_stream, relative_error

TOLERANCE = 1e-5


def block_ends(start: int, length: int, stride: int, block_size: int) -> torch.Tensor:
    """End position of each vector's source block, by walking the stream's blocks."""
    covered_end = start + length * stride
    ends = []
    block_start = start
    while block_start < covered_end:
        block_end = min(block_start + block_size, covered_end)
        vectors_in_block = range(block_start, block_end)
        ends += [block_end for first in vectors_in_block if (first - start) % stride == 0]
        block_start = block_end
    return torch.tensor(ends, dtype=torch.long)


def oracle(q, q_positions, keys, values, key_positions, ends, lifetime, scale, bias):
    shown_from, hidden_from = lifetime
    positions = q_positions.long()[:, None]
    visible = key_positions[None, :] <= positions
    if shown_from is not None:
        visible &= positions >= ends[None, :] + shown_from
    if hidden_from is not None:
        visible &= positions < ends[None, :] + hidden_from
    mask = torch.where(visible, torch.tensor(bias), torch.tensor(-math.inf))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(),
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    return out.nan_to_num(0.0), visible.any(dim=1)


# (stride, block_size, shown_from, hidden_from, K format, V format)
CASES = [
    (1, 8, 12, None, "fp8_g16", "fp4_g32"),  # demoted copies: shown 12 tokens after their block
    (1, 16, None, 20, "fp16", "fp16"),  # recent copies: hidden 20 tokens after their block
    (1, 8, 4, 30, "fp4_g16_e4m3", "fp8"),  # a demoted window block, later pooled
    (4, 16, 24, None, "fp8_g32", "fp8_g32"),  # summaries: shown once their block left the window
]


@pytest.mark.parametrize("stride,block_size,shown_from,hidden_from,k_name,v_name", CASES)
def test_lifetimes_show_each_vector_to_its_positions(
    stride, block_size, shown_from, hidden_from, k_name, v_name
):
    lengths, starts = [45, 21, 0], [3, 0, 7]
    case = build_stream(
        lengths,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        k_fmt=FORMATS[k_name],
        v_fmt=FORMATS[v_name],
        start_positions=starts,
        position_stride=stride,
        logit_bias=math.log(stride),
    )
    stream = dataclasses.replace(case.stream, shown_from=shown_from, hidden_from=hidden_from)
    # Each sequence's queries sweep from before its first key to well past its last block.
    q_lens = [length * stride + 40 for length in lengths]
    positions = [torch.arange(q_len) + start for q_len, start in zip(q_lens, starts, strict=True)]
    q_positions = torch.cat(positions).to(torch.int32)
    q_seq_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(2))
    scale = 64**-0.5

    triton_out, _ = stream_attention(q, q_positions, q_seq_starts, stream, scale)
    reference_out, _ = stream_attention_ref(q, q_positions, q_seq_starts, stream, scale)
    torch_out = cache_attention_torch(q, q_positions, q_seq_starts, [stream], scale)
    hidden_somewhere = False
    for seq, (length, start) in enumerate(zip(lengths, starts, strict=True)):
        begin, end = int(q_seq_starts[seq]), int(q_seq_starts[seq + 1])
        expected, seen = oracle(
            q[begin:end],
            q_positions[begin:end],
            case.keys[seq],
            case.values[seq],
            case.key_positions[seq],
            block_ends(start, length, stride, block_size),
            (shown_from, hidden_from),
            scale,
            math.log(stride),
        )
        causal_only = (case.key_positions[seq][None, :] <= q_positions[begin:end, None]).any(1)
        hidden_somewhere |= bool((causal_only & ~seen).any())
        for out in (triton_out, reference_out, torch_out):
            if seen.any():
                assert relative_error(out[begin:end][seen], expected[seen]) <= TOLERANCE
            assert torch.all(out[begin:end][~seen] == 0)
    assert hidden_somewhere, "the lifetime hid nothing: the case checks nothing"
