"""Decode attention on the torch backend: each stream's blocks dequantized straight into SDPA's
[seq, head, token, channel] layout, then one fused SDPA call over all streams.

A decode step reads every stored vector of its streams once. Read by the pool's generic reader,
vectors come out as [seq, token, head, channel], a concatenation transposes them for SDPA, and
streams of unequal lengths need an additive mask. Here each pool is decoded into its slice of
one preallocated buffer in the layout SDPA reads (`kvtune.kernels.cache.pool.read_blocks_into`). A
mask is built only where something must be hidden: a stream whose sequences all end at one
length (any stream of a batch of one) is cut there and the next stream is written over the
rows past it; rows past unequal lengths are zeroed by index. Timings against the paths this
replaced: `git show c6e261c:benchmarks/RESULTS.md`, stop 36; today's decode ratios:
benchmarks/RESULTS.md, "CSA pooling and selection".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.query_groups import query_groups
from kvtune.kernels.cache.pool import read_blocks_into


@dataclass(frozen=True)
class _Part:
    """One stream's share of a decode step: its view of the group's sequences, the longest
    length, its tokens in whole blocks, and whether every sequence ends at that length."""

    stream: PagedStream
    longest: int
    tokens: int
    equal: bool


def _parts(streams: Sequence[PagedStream], seqs: torch.Tensor) -> list[_Part]:
    """The streams that hold vectors for sequences seqs."""
    parts = []
    for stream in streams:
        sub_stream = stream if len(seqs) == stream.num_seqs else stream.select(seqs)
        lengths = sub_stream.lengths.tolist()
        longest = max(lengths)
        if longest:
            tokens = -(-longest // stream.block_size) * stream.block_size
            parts.append(_Part(sub_stream, longest, tokens, min(lengths) == longest))
    return parts


def decode_attention_torch(
    q: torch.Tensor,
    q_seq_starts: torch.Tensor,
    streams: Sequence[PagedStream],
    scale: float,
) -> torch.Tensor:
    """out fp32 [Nq, Hq, D] of decode queries (one a sequence, seeing every stored vector of
    its streams, within each stream's query_mask and with its logit bias), in one softmax over
    all streams."""
    num_tokens, num_q_heads, head_dim = q.shape
    heads = streams[0].num_kv_heads
    out = None  # made only where groups are several or a sequence sees nothing
    for group in query_groups(q_seq_starts):
        if group.rows.shape[1] != 1:
            raise ValueError(
                f"q_seq_starts: decode takes one query a sequence, not {group.rows.shape[1]}"
            )
        rows = group.rows[:, 0]
        parts = _parts(streams, group.seqs)
        if not parts:
            continue
        total = sum(part.tokens for part in parts)
        keys = torch.empty(len(rows), heads, total, head_dim, device=q.device)
        values = torch.empty_like(keys)
        hidden: list[tuple[torch.Tensor | None, float, int]] = []
        start = 0
        for part in parts:
            stop = start + part.tokens
            table = part.stream.block_table[:, : part.tokens // part.stream.block_size]
            table = table.to(part.stream.k.codes.device)  # padding ids: rows cut or zeroed
            read_blocks_into(part.stream.k, table, keys[:, :, start:stop])
            read_blocks_into(part.stream.v, table, values[:, :, start:stop])
            mask = None
            if part.equal:  # cut where its sequences end: the next stream writes over the rest
                stop = start + part.longest
            else:  # zeroed, so that garbage cannot turn a zero weight into NaN
                mask = _padding(part, keys[:, :, start:stop], values[:, :, start:stop])
            if part.stream.query_mask is not None:  # per KV head: [S, H, 1, T]
                shown = part.stream.query_mask[rows][..., : stop - start]
                shown = F.pad(shown, (0, stop - start - shown.shape[-1]))[:, :, None, :]
                mask = ~shown if mask is None else mask | ~shown
            hidden.append((mask, part.stream.logit_bias, stop - start))
            start = stop
        additive = _additive_mask(hidden, len(rows), num_q_heads, q.device)
        every_row = len(rows) == num_tokens  # the only group: rows 0 ... N - 1 in order
        group_out = F.scaled_dot_product_attention(
            (q if every_row else q[rows]).float()[:, :, None, :],
            keys[:, :, :start],
            values[:, :, :start],
            attn_mask=additive,
            scale=scale,
            enable_gqa=True,
        )[:, :, 0]
        # A sequence that sees no vector gets NaN from SDPA; its output stays 0.
        group_out = group_out if additive is None else group_out.nan_to_num(0.0)
        if every_row:
            return group_out
        out = _zeros(q) if out is None else out
        out[rows] = group_out
    return _zeros(q) if out is None else out


def _zeros(q: torch.Tensor) -> torch.Tensor:
    """fp32 zeros shaped like q: the output of queries that see no vector."""
    return torch.zeros(q.shape, dtype=torch.float32, device=q.device)


def _padding(part: _Part, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """bool [S, 1, 1, T]: the rows past each sequence's length, zeroed in keys and values by
    index (a few rows: a masked fill of the whole buffer cost as much as the attention)."""
    positions = torch.arange(part.tokens, device=keys.device)
    padding = positions[None, :] >= part.stream.lengths.to(keys.device)[:, None]
    seqs, rows = torch.nonzero(padding, as_tuple=True)
    keys[seqs, :, rows] = 0.0
    values[seqs, :, rows] = 0.0
    return padding[:, None, None, :]


def _additive_mask(
    hidden: list[tuple[torch.Tensor | None, float, int]],
    seqs: int,
    num_q_heads: int,
    device: torch.device,
) -> torch.Tensor | None:
    """fp32 [S, 1 or Hq, 1, T] from each stream's (hidden [S, 1 or Hkv, 1, tokens] or None,
    logit bias, tokens): the bias, -inf where hidden; None when nothing is hidden or biased
    (SDPA's unmasked path)."""
    if all(mask is None and bias == 0.0 for mask, bias, _ in hidden):
        return None
    heads = max(1 if mask is None else mask.shape[1] for mask, _, _ in hidden)
    pieces = []
    for mask, bias, tokens in hidden:
        piece = torch.full((seqs, heads, 1, tokens), bias, device=device)
        pieces.append(piece if mask is None else piece.masked_fill(mask, -math.inf))
    additive = torch.cat(pieces, -1)
    return additive if heads == 1 else additive.repeat_interleave(num_q_heads // heads, dim=1)
