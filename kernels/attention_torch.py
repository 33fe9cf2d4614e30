"""Batched torch attention over a paged stream: the fast CPU path of the `torch` backend.

`kernels.attention.paged_attention_ref` is the readable oracle (one sequence at a time); this
computes the same result for every sequence at once: gather the stream's vectors for all
sequences (padded to the longest), dequantize them in one call, and run two batched matmuls.
Same signatures as the Triton launchers, so the runtime can swap them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


@dataclass(frozen=True)
class _PaddedQueries:
    """Packed queries laid out [B, Q, Hq, D] (Q = longest chunk) with their positions."""

    queries: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor  # [B, Q]
    rows: torch.Tensor  # packed row of each valid (b, q), in order


def _pad_queries(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    max_q_len: int | None,
) -> _PaddedQueries:
    device = q.device
    starts = q_seq_starts.long()
    counts = starts[1:] - starts[:-1]
    width = max_q_len or int(counts.max())
    offsets = torch.arange(width, device=device)
    valid = offsets[None, :] < counts[:, None]
    rows = (starts[:-1, None] + offsets[None, :])[valid]
    num_seqs = counts.shape[0]
    queries = torch.zeros(num_seqs, width, *q.shape[1:], device=device)
    queries[valid] = q[rows].float()
    positions = torch.zeros(num_seqs, width, dtype=torch.long, device=device)
    if q_positions is not None:
        positions[valid] = q_positions.long()[rows]
    return _PaddedQueries(queries, positions, valid, rows)


def _visible(
    padded: _PaddedQueries, key_positions: torch.Tensor, key_valid: torch.Tensor, causal: bool
) -> torch.Tensor:
    """bool [B, Q, L]: which keys each query may attend to."""
    visible = key_valid[:, None, :]
    if causal:
        return visible & (key_positions[:, None, :] <= padded.positions[:, :, None])
    return visible.expand(-1, padded.queries.shape[1], -1)


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
    padded = _pad_queries(q, q_positions, q_seq_starts, max_q_len)
    num_seqs, width = padded.valid.shape
    num_kv_heads = stream.num_kv_heads
    group = num_q_heads // num_kv_heads
    keys, values, key_positions, key_valid = _gather_stream(stream, max_len)
    # [B, Hkv, Q * G, D] x [B, Hkv, D, L]: every query head of a KV head in one matmul.
    queries = padded.queries.view(num_seqs, width, num_kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(
        num_seqs, num_kv_heads, width * group, head_dim
    )
    logits = queries @ keys.permute(0, 2, 3, 1)
    visible = _visible(padded, key_positions, key_valid, q_positions is not None)
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
    out[padded.rows] = seq_out[padded.valid]
    lse[padded.rows] = seq_lse[padded.valid]
    return out, lse


def single_stream_attention_torch(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """out fp32 [Nq, Hq, D] when the stream is a sequence's whole cache: no log-sum-exp is
    needed for merging, so torch's fused scaled_dot_product_attention does the work."""
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    max_len = int(stream.lengths.max()) if stream.num_seqs else 0
    if num_tokens == 0 or max_len == 0:
        return out
    padded = _pad_queries(q, q_positions, q_seq_starts, max_q_len)
    keys, values, key_positions, key_valid = _gather_stream(stream, max_len)
    visible = _visible(padded, key_positions, key_valid, q_positions is not None)
    mask = torch.full(visible.shape, -math.inf, device=q.device).masked_fill(
        visible, stream.logit_bias
    )
    seq_out = F.scaled_dot_product_attention(
        padded.queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)
    # Padded query rows may see no key (NaN from SDPA); they are dropped here.
    out[padded.rows] = seq_out[padded.valid].nan_to_num(0.0)
    return out


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
