"""Batched torch attention over a paged stream: the fast CPU path of the `torch` backend.

`kernels.attention.paged_attention_ref` is the readable oracle (one sequence at a time); this
computes the same result for every sequence at once: gather the stream's vectors for all
sequences (padded to the longest), dequantize them in one call, and run two batched matmuls.
Same signatures as the Triton launchers, so the runtime can swap them.
"""

from __future__ import annotations

import math

import torch

from kernels.attention import PagedStream
from kernels.pool import read_vectors_ref


def _gather_stream(stream: PagedStream, max_len: int) -> tuple[torch.Tensor, ...]:
    """fp32 K, V [B, L, Hkv, D] (rows past a sequence's length zeroed), key positions [B, L]
    and validity [B, L]."""
    device = stream.block_table.device
    num_seqs, block_size = stream.num_seqs, stream.block_size
    index = torch.arange(max_len, device=device)
    valid = index[None, :] < stream.lengths.long()[:, None]
    table_column = (index // block_size).clamp(max=stream.block_table.shape[1] - 1)
    blocks = stream.block_table.long()[:, table_column].clamp(min=0)
    slots = (blocks * block_size + index % block_size).flatten()
    shape = (num_seqs, max_len, stream.num_kv_heads, stream.head_dim)
    invalid = ~valid[:, :, None, None]
    keys = read_vectors_ref(stream.k, slots).view(shape).masked_fill(invalid, 0.0)
    values = read_vectors_ref(stream.v, slots).view(shape).masked_fill(invalid, 0.0)
    stride = stream.position_stride
    positions = stream.start_positions.long()[:, None] + index[None, :] * stride + stride - 1
    return keys, values, positions, valid


def paged_attention_torch(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out fp32 [Nq, Hq, D], lse fp32 [Nq, Hq] of packed queries over one stream.

    q_positions None means no causal mask (decode: the query follows every key).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    device = q.device
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float32, device=device)
    max_len = int(stream.lengths.max()) if stream.num_seqs else 0
    if num_tokens == 0 or max_len == 0:
        return out, lse
    starts = q_seq_starts.long()
    counts = starts[1:] - starts[:-1]
    width = max_q_len or int(counts.max())
    offsets = torch.arange(width, device=device)
    q_valid = offsets[None, :] < counts[:, None]  # [B, Q]
    q_rows = (starts[:-1, None] + offsets[None, :])[q_valid]
    num_seqs, num_kv_heads = stream.num_seqs, stream.num_kv_heads
    group = num_q_heads // num_kv_heads

    keys, values, key_positions, key_valid = _gather_stream(stream, max_len)
    queries = torch.zeros(num_seqs, width, num_q_heads, head_dim, device=device)
    queries[q_valid] = q[q_rows].float()
    # [B, Hkv, Q * G, D] x [B, Hkv, D, L]: every query head of a KV head in one matmul.
    queries = queries.view(num_seqs, width, num_kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(
        num_seqs, num_kv_heads, width * group, head_dim
    )
    logits = queries @ keys.permute(0, 2, 3, 1)
    visible = key_valid[:, None, :]  # [B, 1, L] against [B, Q, L]
    if q_positions is not None:
        padded_positions = torch.zeros(num_seqs, width, dtype=torch.long, device=device)
        padded_positions[q_valid] = q_positions.long()[q_rows]
        visible = visible & (key_positions[:, None, :] <= padded_positions[:, :, None])
    # Additive mask [B, 1, Q, 1, L], shared by every head; logits become [B, Hkv, Q, G, L].
    bias = torch.full(visible.shape, -math.inf, device=device).masked_fill(visible, 0.0)
    logits = logits.view(num_seqs, num_kv_heads, width, group, max_len).mul_(scale)
    logits.add_(bias[:, None, :, None, :] + stream.logit_bias)
    seq_lse = torch.logsumexp(logits, dim=-1)
    # A query that sees no key has lse -inf: its weights exp(-inf - 0) are 0, not NaN.
    weights = logits.sub_(seq_lse.nan_to_num(neginf=0.0)[..., None]).exp_()
    weights = weights.view(num_seqs, num_kv_heads, width * group, max_len)
    seq_out = (weights @ values.permute(0, 2, 1, 3)).view(
        num_seqs, num_kv_heads, width, group, head_dim
    )
    # Back to packed rows: [B, Q, Hkv, G, D] -> [Nq, Hq, D].
    seq_out = seq_out.permute(0, 2, 1, 3, 4).reshape(num_seqs, width, num_q_heads, head_dim)
    seq_lse = seq_lse.permute(0, 2, 1, 3).reshape(num_seqs, width, num_q_heads)
    out[q_rows] = seq_out[q_valid]
    lse[q_rows] = seq_lse[q_valid]
    return out, lse


def stream_attention_torch(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.attention.stream_attention` (causal prefill / extend)."""
    return paged_attention_torch(q, q_positions, q_seq_starts, stream, scale, max_q_len)


def decode_attention_torch(
    q: torch.Tensor, stream: PagedStream, scale: float, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.attention_decode.decode_attention` (num_splits is unused)."""
    seq_starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_torch(q, None, seq_starts, stream, scale, max_q_len=1)
