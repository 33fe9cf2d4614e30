"""Paged attention at each tl.dot precision, against fp32 SDPA and its log-sum-exp: each
tolerance names the precision it assumes.

- ieee: fp32 products and sums; only summation order and exp2 differ from the oracle: 1e-5.
- tf32: q, k, p and v are rounded to 10 mantissa bits before each product. Emulating that
  rounding around an fp32 attention over random vectors (D 64-128, up to 1000 keys) gives at
  most 4.9e-4 relative error in the output and 8.6e-4 in the LSE
  (`python -m benchmarks.dot_precision --emulate`), hence 3e-3.

The interpreter computes every dot in fp32 whatever the precision asked, so the tf32 cases
run on CUDA only (KVTUNE_TEST_DEVICE=cuda, benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtune.kernels.attention.decode import decode_attention
from kvtune.kernels.attention.paged import stream_attention
from tests.conftest import TEST_DEVICE
from tests.kernels.attention.test_attention import (
    FORMATS,
    StreamCase,
    build_stream,
    extend_queries,
    relative_error,
    sdpa_oracle,
)

DOT_TOLERANCE = {"ieee": 1e-5, "tf32": 3e-3}
PRECISIONS = [
    "ieee",
    pytest.param(
        "tf32",
        marks=pytest.mark.skipif(
            TEST_DEVICE == "cpu", reason="the interpreter computes tf32 dots in fp32"
        ),
    ),
]
# (head_dim, num_kv_heads, GQA group, block_size, K format, V format)
SHAPES = [
    (128, 2, 4, 16, "fp16", "bf16"),
    (64, 1, 7, 32, "fp8_g16", "fp4_g32"),
    (128, 2, 8, 16, "fp4_g16_e4m3", "fp8"),
]


def oracle_errors(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    case: StreamCase,
    scale: float,
) -> tuple[float, float]:
    """(relative error of out, largest LSE error relative to max(1, |lse|)) against SDPA and
    the log-sum-exp of the same masked fp32 logits, over query rows that see a key."""
    out_errors, lse_errors = [], [0.0]
    for seq in range(len(q_seq_starts) - 1):
        begin, end = int(q_seq_starts[seq]), int(q_seq_starts[seq + 1])
        keys, values = case.keys[seq], case.values[seq]
        positions = None if q_positions is None else q_positions[begin:end]
        bias = torch.full((len(keys),), case.stream.logit_bias)
        expected, has_keys = sdpa_oracle(
            q[begin:end], positions, keys, values, case.key_positions[seq], bias, scale
        )
        if not has_keys.any():
            continue
        out_errors.append(relative_error(out[begin:end][has_keys], expected[has_keys]))
        group = q.shape[1] // keys.shape[1]
        logits = torch.einsum(
            "thd,lhd->thl", q[begin:end].float(), keys.repeat_interleave(group, dim=1)
        )
        logits = logits * scale + case.stream.logit_bias
        if positions is not None:
            hidden = case.key_positions[seq][None, :] > positions[:, None].long()
            logits = logits.masked_fill(hidden[:, None, :], -math.inf)
        expected_lse = torch.logsumexp(logits, dim=-1)[has_keys]
        error = (lse[begin:end][has_keys] - expected_lse).abs() / expected_lse.abs().clamp_min(1)
        lse_errors.append(error.max().item())
    return max(out_errors, default=0.0), max(lse_errors)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("head_dim,num_kv_heads,group,block_size,k_name,v_name", SHAPES)
def test_prefill_and_decode_within_their_precision(
    precision, head_dim, num_kv_heads, group, block_size, k_name, v_name
):
    case = build_stream(
        [1, 37, 150],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        k_fmt=FORMATS[k_name],
        v_fmt=FORMATS[v_name],
        start_positions=[0, 5, 0],
    )
    q, q_positions, q_seq_starts = extend_queries([1, 5, 9], case, num_kv_heads * group)
    scale = head_dim**-0.5
    tolerance = DOT_TOLERANCE[precision]
    out, lse = stream_attention(
        q, q_positions, q_seq_starts, case.stream, scale, dot_precision=precision
    )
    out_error, lse_error = oracle_errors(out, lse, q, q_positions, q_seq_starts, case, scale)
    assert out_error <= tolerance and lse_error <= tolerance

    q_decode = q[q_seq_starts[1:].long() - 1]  # each sequence's last query, after every key
    decode_starts = torch.arange(4, dtype=torch.int32)
    out, lse = decode_attention(q_decode, case.stream, scale, 3, dot_precision=precision)
    out_error, lse_error = oracle_errors(out, lse, q_decode, None, decode_starts, case, scale)
    assert out_error <= tolerance and lse_error <= tolerance
