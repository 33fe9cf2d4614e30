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
from kernels.pool import read_blocks_ref


def _gather_stream(stream: PagedStream, max_len: int) -> tuple[torch.Tensor, ...]:
    """fp32 K, V [B, L, Hkv, D] (rows past a sequence's length zeroed, so that garbage there
    cannot turn a zero weight into NaN), key positions [B, L] and validity [B, L]."""
    device = stream.block_table.device
    num_blocks = -(-max_len // stream.block_size)
    table = stream.block_table[:, :num_blocks].clamp(min=0)
    keys = read_blocks_ref(stream.k, table)[:, :max_len]
    values = read_blocks_ref(stream.v, table)[:, :max_len]
    index = torch.arange(max_len, device=device)
    valid = index[None, :] < stream.lengths.long()[:, None]
    padding = torch.nonzero(~valid, as_tuple=True)  # few rows: cheaper than a dense mask
    keys[padding] = 0.0  # in place: the gather made fresh tensors
    values[padding] = 0.0
    stride = stream.position_stride
    positions = stream.start_positions.long()[:, None] + index[None, :] * stride + stride - 1
    return keys, values, positions, valid


@dataclass(frozen=True)
class _QueryGroup:
    """Sequences with the same number of queries, attended in one batched call: a decode step's
    sequences share one group and each prefill chunk length another, so no sequence pays for a
    longer one's queries (padding every sequence to the longest chunk made a mixed step cost
    batch x chunk x context)."""

    rows: torch.Tensor  # [S, C] packed query row of each (sequence, query)
    stream: PagedStream  # the group's sequences only
    max_len: int  # longest stream of the group (keys gathered)


def _query_groups(q_seq_starts: torch.Tensor, stream: PagedStream) -> list[_QueryGroup]:
    starts = q_seq_starts.long()
    counts = starts[1:] - starts[:-1]
    groups = []
    for count in torch.unique(counts).tolist():
        seqs = torch.nonzero(counts == count).flatten()
        sub_stream = stream.select(seqs)
        max_len = int(sub_stream.lengths.max())
        if count == 0 or max_len == 0:
            continue
        offsets = torch.arange(count, device=starts.device)
        groups.append(_QueryGroup(starts[seqs][:, None] + offsets[None, :], sub_stream, max_len))
    return groups


def _visible(
    q_positions: torch.Tensor | None,
    rows: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
) -> torch.Tensor:
    """bool [S, C, L]: which keys each query may attend to (all valid keys without positions)."""
    visible = key_valid[:, None, :]
    if q_positions is None:
        return visible.expand(-1, rows.shape[1], -1)
    positions = q_positions.long()[rows]
    return visible & (key_positions[:, None, :] <= positions[:, :, None])


def _group_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    group: _QueryGroup,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out fp32 [S, C, Hq, D] and lse [S, C, Hq] of one group over its stream."""
    stream = group.stream
    num_seqs, width = group.rows.shape
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = stream.num_kv_heads
    heads_per_kv = num_q_heads // num_kv_heads
    keys, values, key_positions, key_valid = _gather_stream(stream, group.max_len)
    # [S, Hkv, C * G, D] x [S, Hkv, D, L]: every query head of a KV head in one matmul.
    queries = q[group.rows].float().view(num_seqs, width, num_kv_heads, heads_per_kv, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(
        num_seqs, num_kv_heads, width * heads_per_kv, head_dim
    )
    logits = queries @ keys.permute(0, 2, 3, 1)
    visible = _visible(q_positions, group.rows, key_positions, key_valid)
    # Additive mask [S, 1, C, 1, L], shared by every head; logits become [S, Hkv, C, G, L].
    bias = torch.full(visible.shape, -math.inf, device=q.device).masked_fill(visible, 0.0)
    logits = logits.view(num_seqs, num_kv_heads, width, heads_per_kv, group.max_len).mul_(scale)
    logits.add_(bias[:, None, :, None, :] + stream.logit_bias)
    lse = torch.logsumexp(logits, dim=-1)
    # A query that sees no key has lse -inf: its weights exp(-inf - 0) are 0, not NaN.
    weights = logits.sub_(lse.nan_to_num(neginf=0.0)[..., None]).exp_()
    weights = weights.view(num_seqs, num_kv_heads, width * heads_per_kv, group.max_len)
    out = (weights @ values.permute(0, 2, 1, 3)).view(
        num_seqs, num_kv_heads, width, heads_per_kv, head_dim
    )
    # [S, Hkv, C, G, ...] -> [S, C, Hq, ...]
    out = out.permute(0, 2, 1, 3, 4).reshape(num_seqs, width, num_q_heads, head_dim)
    return out, lse.permute(0, 2, 1, 3).reshape(num_seqs, width, num_q_heads)


def paged_attention_torch(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out fp32 [Nq, Hq, D], lse fp32 [Nq, Hq] of packed queries over one stream.

    q_positions None means no causal mask (decode: the query follows every key). max_q_len
    only matters to the Triton launch; it is accepted for the same signature.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    for group in _query_groups(q_seq_starts, stream):
        group_out, group_lse = _group_attention(q, q_positions, group, scale)
        rows = group.rows.flatten()
        out[rows] = group_out.flatten(0, 1)
        lse[rows] = group_lse.flatten(0, 1)
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
    for group in _query_groups(q_seq_starts, stream):
        keys, values, key_positions, key_valid = _gather_stream(group.stream, group.max_len)
        visible = _visible(q_positions, group.rows, key_positions, key_valid)
        mask = torch.full(visible.shape, -math.inf, device=q.device).masked_fill(
            visible, group.stream.logit_bias
        )
        group_out = F.scaled_dot_product_attention(
            q[group.rows].float().transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        # A sequence without keys yields NaN from SDPA; its output stays 0.
        out[group.rows.flatten()] = group_out.flatten(0, 1).nan_to_num(0.0)
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
