"""Decode attention over quantized streams without dequantizing them: group scales and zero
points folded into the queries and the softmax weights.

A stored vector is scale * number + zero per group (the number being what the element code
decodes to), so q.k = sum_g scale_g (q_g . numbers_g) + sum_g zero_g sum(q_g), and the weighted
sum of values splits the same way. On a CPU, dequantizing a decode step's selected blocks
(multiply, add, then concatenate before SDPA) cost about as many passes over the vectors as the
attention itself; folding reads the decoded numbers once, in the layout the products want, and
applies scales to queries and weights, which are a few hundred numbers a head. Streams whose
pools do not fold (no group scales, Lloyd or zero-in-scale codes, fp16) are read dequantized
and join the same softmax. `kvtune.kernels.attention_torch` uses this for decode steps that
read a folding pool; its SDPA path stays the oracle and the path of everything else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtune.kernels import element_formats
from kvtune.kernels.attention import PagedStream
from kvtune.kernels.pool import KVPool, gather_blocks, read_blocks_ref
from kvtune.kernels.query_groups import QueryGroup, query_groups


def folds(pool: KVPool) -> bool:
    """Whether pool stores scale * element number (+ zero) per group, which folding assumes
    (`kvtune.kernels.quantize.dequantize_ref` decodes Lloyd and zero-in-scale codes otherwise)."""
    fmt = pool.fmt
    return (
        pool.scales is not None
        and fmt.element.family != element_formats.CODE_LLOYD
        and fmt.dtype != "int4_zp_in_scale"
    )


@dataclass(frozen=True)
class BlockVectors:
    """A stream's vectors for a group of sequences, T = blocks read * block_size of them, as
    numbers and what makes them values: vector t of head h is
    numbers[t] * scale[t] + zero[t // rows] per group of head_dim / G channels.

    scale is None where the numbers carry it already: pools that do not fold (the numbers are
    the values) and token-grouped pools (scale rows serving `rows` vectors per channel, such
    as per-channel keys, multiplied in when read: folding them into the queries took a batched
    product per scale row, slower than the multiply). Rows past a sequence's length are zero,
    so that a zero weight stays zero."""

    numbers: torch.Tensor  # fp32 [S, H, T, D]
    scale: torch.Tensor | None  # fp32 [S, H, T, G]
    zero: torch.Tensor | None  # fp32 [S, H, T / rows, G], or None (symmetric formats)
    rows: int


def read_block_vectors(
    pool: KVPool, table: torch.Tensor, padding: torch.Tensor | None, device: torch.device
) -> BlockVectors:
    """The vectors of the blocks `table` [S, blocks] lists (valid ids, on the pool's device) on
    `device`, the one that attends (a host-tier pool may live elsewhere: its codes are gathered
    where they are and moved, a quarter of the fp32 numbers' bytes). padding: bool [S, T], the
    rows past each sequence's length, or None where there are none."""
    seqs = table.shape[0]
    fmt = pool.fmt
    if not folds(pool):
        values = read_blocks_ref(pool, table).to(device).transpose(1, 2).contiguous()
        if padding is not None:
            values.masked_fill_(padding[:, None, :, None], 0.0)
        return BlockVectors(values, None, None, 1)
    rows = fmt.token_group
    # Codes put in [S, H, blocks, block_size, bytes] before decoding, so that the numbers come
    # out contiguous in the layout the products read.
    codes = gather_blocks(pool.codes, table).to(device)  # [S, blocks, block_size, H, bytes]
    numbers = fmt.element.decode(codes.permute(0, 3, 1, 2, 4)).flatten(2, 3)  # [S, H, T, D]
    stored = gather_blocks(pool.scales, table).to(device)  # [S, blocks, bs / rows, H, W]
    scales = fmt.scale_format.decode(stored).flatten(1, 2).transpose(1, 2)  # [S, H, T/rows, W]
    if not pool.unit_tensor_scale:
        scales = scales * pool.tensor_scale.to(device)
    groups = pool.head_dim // fmt.group_size
    scale, zero = scales[..., :groups], scales[..., groups:] if fmt.zero_point else None
    if padding is not None:
        numbers.masked_fill_(padding[:, None, :, None], 0.0)  # decoding made them fresh
        unused = padding.view(seqs, 1, -1, rows).all(-1)[..., None]
        scale = scale.masked_fill(unused, 0.0)
        zero = None if zero is None else zero.masked_fill(unused, 0.0)
    if rows > 1:
        by_row = numbers.unflatten(2, (-1, rows))  # [S, H, T / rows, rows, D]
        by_row *= _per_channel(scale, pool.head_dim)[:, :, :, None, :]
        scale = None
    return BlockVectors(numbers, scale, zero, rows)


def _per_channel(scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., G] group scales -> [..., head_dim], each repeated over its group's channels."""
    groups = scale.shape[-1]
    return scale if groups == head_dim else scale.repeat_interleave(head_dim // groups, dim=-1)


def key_logits(q: torch.Tensor, keys: BlockVectors) -> torch.Tensor:
    """[S, H, g, T]: each query head q [S, H, g, D] dotted with its KV head's keys."""
    scale = keys.scale
    if scale is None or scale.shape[-1] == 1:  # one number a vector, or one group
        logits = (keys.numbers @ q.transpose(-1, -2)).transpose(-1, -2)
        if scale is not None:
            logits = logits * scale[..., 0][:, :, None, :]
    else:  # several groups a vector: each group's dot product, then its scale
        groups = scale.shape[-1]
        dots = torch.einsum(
            "shtkn,shjkn->shjtk",
            keys.numbers.unflatten(-1, (groups, -1)),
            q.unflatten(-1, (groups, -1)),
        )
        logits = (dots * scale[:, :, None]).sum(-1)
    if keys.zero is None:
        return logits
    sums = q.unflatten(-1, (keys.zero.shape[-1], -1)).sum(-1)  # [S, H, g, G]
    offsets = sums @ keys.zero.transpose(-1, -2)  # [S, H, g, T / rows]
    by_row = logits.unflatten(-1, (-1, keys.rows)) + offsets[..., None]
    return by_row.flatten(-2)


def weighted_values(weights: torch.Tensor, values: BlockVectors) -> torch.Tensor:
    """[S, H, g, D]: softmax weights [S, H, g, T] times the values."""
    numbers, scale = values.numbers, values.scale
    if scale is None:
        out = weights @ numbers
    elif scale.shape[-1] == 1:
        out = (weights * scale[..., 0][:, :, None, :]) @ numbers
    else:
        groups = scale.shape[-1]
        scaled = weights[..., None] * scale[:, :, None]  # [S, H, g, T, G]
        out = torch.einsum("shjtk,shtkn->shjkn", scaled, numbers.unflatten(-1, (groups, -1)))
        out = out.flatten(-2)
    if values.zero is None:
        return out
    mass = weights.unflatten(-1, (-1, values.rows)).sum(-1)  # [S, H, g, T / rows]
    return out + _per_channel(mass @ values.zero, numbers.shape[-1])


def folds_any(streams: Sequence[PagedStream]) -> bool:
    """Whether a decode step over streams reads a pool that folds (else SDPA is as cheap)."""
    return any(folds(stream.k) or folds(stream.v) for stream in streams)


def folded_decode_attention(
    q: torch.Tensor,
    q_seq_starts: torch.Tensor,
    streams: Sequence[PagedStream],
    scale: float,
) -> torch.Tensor:
    """out fp32 [Nq, Hq, D] of decode queries (one a sequence, seeing every stored vector of
    its streams, within each stream's query_mask), in one softmax over all streams."""
    num_tokens, num_q_heads, head_dim = q.shape
    heads = streams[0].num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for group in query_groups(q_seq_starts):
        if group.rows.shape[1] != 1:
            raise ValueError(
                f"q_seq_starts: decode takes one query a sequence, not {group.rows.shape[1]}"
            )
        rows = group.rows[:, 0]
        queries = (q[rows].float() * scale).view(len(rows), heads, num_q_heads // heads, head_dim)
        parts = [_stream_part(stream, group, queries) for stream in streams]
        parts = [part for part in parts if part is not None]
        if not parts:
            continue
        weights = torch.softmax(torch.cat([logits for logits, _ in parts], -1), -1)
        weights = weights.nan_to_num(0.0)  # a sequence without visible vectors: output 0
        group_out = torch.zeros_like(queries)
        for chunk, (_, values) in zip(
            weights.split([logits.shape[-1] for logits, _ in parts], -1), parts, strict=True
        ):
            group_out += weighted_values(chunk, values)
        out[rows] = group_out.flatten(1, 2)
    return out


def _stream_part(
    stream: PagedStream, group: QueryGroup, queries: torch.Tensor
) -> tuple[torch.Tensor, BlockVectors] | None:
    """(masked, biased logits [S, H, g, T], values) of one stream for a group's queries."""
    sub_stream = stream if len(group.seqs) == stream.num_seqs else stream.select(group.seqs)
    longest = int(sub_stream.lengths.max())
    if longest == 0:
        return None
    blocks = -(-longest // stream.block_size)
    table = sub_stream.block_table[:, :blocks].clamp(min=0).to(stream.k.codes.device)
    tokens, device = blocks * stream.block_size, queries.device
    valid = torch.arange(tokens, device=device)[None, :] < sub_stream.lengths[:, None]
    # Checked once: a batch of one, or of equal lengths in whole blocks, masks nothing.
    padding = None if bool(valid.all()) else ~valid
    keys = read_block_vectors(stream.k, table, padding, device)
    values = read_block_vectors(stream.v, table, padding, device)
    hidden = None if padding is None else padding[:, None, None, :]  # [S, 1, 1, T]
    if stream.query_mask is not None:  # per KV head: [S, H, 1, T]
        shown = stream.query_mask[group.rows[:, 0]][..., :longest]
        shown = F.pad(shown, (0, tokens - longest))[:, :, None, :]
        hidden = ~shown if hidden is None else hidden | ~shown
    logits = key_logits(queries, keys)
    if hidden is not None:
        logits = logits.masked_fill(hidden, -math.inf)
    if stream.logit_bias:
        logits = logits + stream.logit_bias
    return logits, values
