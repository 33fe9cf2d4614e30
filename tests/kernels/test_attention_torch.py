"""The batched torch path equals the per-sequence reference and SDPA."""

import pytest
import torch

from kernels.attention import stream_attention_ref
from kernels.attention_decode import decode_attention_ref
from kernels.attention_torch import (
    decode_attention_torch,
    single_stream_attention_torch,
    stream_attention_torch,
)
from tests.kernels.test_attention import (
    FORMATS,
    LENGTHS,
    SHAPES,
    assert_close,
    assert_matches_sdpa,
    build_stream,
    extend_queries,
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
    result = stream_attention_torch(q, q_positions, q_seq_starts, case.stream, scale)
    assert_close(result, stream_attention_ref(q, q_positions, q_seq_starts, case.stream, scale))
    if not summary:
        assert_matches_sdpa(*result, q, q_positions, q_seq_starts, [case], scale)
    decode_q = q[: len(LENGTHS)]
    decode_reference = decode_attention_ref(decode_q, case.stream, scale)
    assert_close(decode_attention_torch(decode_q, case.stream, scale), decode_reference)
    # Without the log-sum-exp (one stream is the whole cache): fused SDPA, same outputs.
    single = single_stream_attention_torch(q, q_positions, q_seq_starts, case.stream, scale)
    assert (single - result[0]).norm() <= 1e-5 * result[0].norm()
    seq_starts = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    single_decode = single_stream_attention_torch(decode_q, None, seq_starts, case.stream, scale)
    assert (single_decode - decode_reference[0]).norm() <= 1e-5 * decode_reference[0].norm()
