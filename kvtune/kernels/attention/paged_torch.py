"""Batched torch attention over paged streams: the fast CPU path of the `torch` backend.

`kvtune.kernels.attention.paged.paged_attention_ref` is the readable oracle (one sequence at a
time); this computes the same result for every sequence at once: gather the stream's vectors for all
sequences (padded to the longest), dequantize them in one call, and attend over every stream of
a sequence's cache with one fused SDPA call. The Triton launchers attend stream by stream and
merge by log-sum-exp; this needs no log-sum-exp, so it never materialises the logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtune.kernels.attention.decode_torch import decode_attention_torch
from kvtune.kernels.attention.identity_memo import IdentityMemo
from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.query_groups import QueryGroup, query_groups
from kvtune.kernels.cache.pool import read_blocks_ref
from kvtune.kernels.native.decode_attention import decode_attention_native


def gather_stream(
    stream: PagedStream, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 K, V [B, L, Hkv, D] and validity [B, L]. Rows past a sequence's length are zeroed,
    so that garbage there cannot turn a zero weight into NaN."""
    device = stream.block_table.device
    num_blocks = -(-max_len // stream.block_size)
    # A host-tier pool may live off the device: read it where it is, attend on the device.
    table = stream.block_table[:, :num_blocks].clamp(min=0).to(stream.k.codes.device)
    keys = read_blocks_ref(stream.k, table)[:, :max_len].to(device)
    values = read_blocks_ref(stream.v, table)[:, :max_len].to(device)
    valid = torch.arange(max_len, device=device)[None, :] < stream.lengths[:, None]
    if not bool(valid.all()):
        padding = torch.nonzero(~valid, as_tuple=True)  # few rows: cheaper than a dense mask
        keys[padding] = 0.0  # in place: the gather made fresh tensors
        values[padding] = 0.0
    return keys, values, valid


def _key_positions(stream: PagedStream, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each stored vector's position [B, L] and the end of its source block [B, L] (for the
    stream's lifetime rule): only a step with query positions (prefill) needs them."""
    index = torch.arange(max_len, device=stream.block_table.device)
    stride, block_size = stream.position_stride, stream.block_size
    starts = stream.start_positions.long()[:, None]
    positions = starts + index[None, :] * stride + stride - 1
    source_block_ends = (index * stride // block_size + 1) * block_size
    block_ends = starts + torch.minimum(
        source_block_ends[None, :], stream.lengths.long()[:, None] * stride
    )
    return positions, block_ends


def merge_decode_streams(streams: Sequence[PagedStream]) -> list[PagedStream]:
    """Streams that a decode step can read as one: the same pools and logit bias, no query
    mask. Decode attends every stored vector whatever its position, so their blocks can share
    one block table and be gathered and dequantized in one call (per call overheads took ~40%
    of a 4-bit CSA decode's gathers with sinks, window and staged blocks read apart). Streams
    of whole blocks go first and at most one stream with a partial last block goes last, so
    each sequence's vectors stay contiguous; another partial stream stays on its own. A run
    that every layer of a step holds alike (sinks and window, without a per-layer staging
    stream beside them) is merged once a step (`_MERGES`)."""
    runs: dict[tuple[int, int, float], list[PagedStream]] = {}
    alone: list[PagedStream] = []
    for stream in streams:
        if stream.query_mask is not None:
            alone.append(stream)
            continue
        runs.setdefault((id(stream.k), id(stream.v), stream.logit_bias), []).append(stream)
    merged = []
    for run in runs.values():
        if len(run) == 1:
            merged.append(run[0])
            continue
        tensors = tuple(t for stream in run for t in (stream.block_table, stream.lengths))
        plan = _MERGES.get(tensors)
        if plan is None:
            plan = _MERGES.put(tensors, _merge_plan(run))
        members, table, lengths, rest = plan
        if table is None:
            merged.append(run[members[0]])
        else:
            merged.append(dataclasses.replace(run[members[0]], block_table=table, lengths=lengths))
        alone.extend(run[i] for i in rest)
    return merged + alone


# (members, merged block table and lengths or None for a single member, the streams left apart)
_MergePlan = tuple[list[int], torch.Tensor | None, torch.Tensor | None, list[int]]


def _merge_plan(run: list[PagedStream]) -> _MergePlan:
    """How merge_decode_streams merges one run of streams over the same pools (see there)."""
    lengths = [stream.lengths.tolist() for stream in run]
    is_whole = [all(n % s.block_size == 0 for n in ns) for s, ns in zip(run, lengths, strict=True)]
    whole = [i for i, flag in enumerate(is_whole) if flag]
    partial = [i for i, flag in enumerate(is_whole) if not flag]
    members = whole + partial[:1]
    if len(members) == 1:
        return members, None, None, partial[1:]
    table, total = _concatenated([run[i] for i in members], [lengths[i] for i in members])
    return members, table, total, partial[1:]


_MERGES = IdentityMemo(8)


def _concatenated(
    streams: list[PagedStream], lengths: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and lengths of one stream holding each sequence's used blocks of
    `streams` (lengths: each stream's per-sequence lengths), in order. Where every sequence
    uses as many blocks of each stream (a batch of one, equal lengths), one concatenation of
    table slices; else built row by row on the host: a decode step's tables are a few hundred
    ids, where a dozen small tensor ops cost more than the loop."""
    block_size = streams[0].block_size
    device = streams[0].block_table.device
    total = torch.tensor([sum(column) for column in zip(*lengths, strict=True)], dtype=torch.int32)
    counts = [[-(-n // block_size) for n in stream_lengths] for stream_lengths in lengths]
    if all(min(count) == max(count) for count in counts):
        table = torch.cat(
            [s.block_table[:, : c[0]] for s, c in zip(streams, counts, strict=True)], dim=1
        )
        return table, total.to(device)
    tables = [stream.block_table.tolist() for stream in streams]
    rows = []
    for seq in range(streams[0].num_seqs):
        row: list[int] = []
        for stream_table, stream_lengths in zip(tables, lengths, strict=True):
            row += stream_table[seq][: -(-stream_lengths[seq] // block_size)]
        rows.append(row)
    table = torch.zeros(len(rows), max(1, max(len(row) for row in rows)), dtype=torch.int32)
    for seq, row in enumerate(rows):
        table[seq, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.to(device), total.to(device)


@dataclass(frozen=True)
class GroupKeys:
    """One stream's vectors for a query group, gathered dense, and which query sees which."""

    keys: torch.Tensor  # fp32 [S, L, Hkv, D]
    values: torch.Tensor  # fp32 [S, L, Hkv, D]
    visible: torch.Tensor  # bool [S, 1 or Hkv (a per-KV-head query_mask), C, L]


def group_keys(
    stream: PagedStream, group: QueryGroup, q_positions: torch.Tensor | None
) -> GroupKeys | None:
    """The group's view of a stream (None when none of its sequences stores a vector there).

    Visible: every valid key without query positions (decode: the query follows every key),
    else the keys whose position the query has reached and whose lifetime covers it; and in
    both cases only where the stream's query_mask, if any, allows."""
    # Groups list their sequences in order: one that holds them all reads the stream as it is.
    every_seq = len(group.seqs) == stream.num_seqs
    sub_stream = stream if every_seq else stream.select(group.seqs)
    max_len = int(sub_stream.lengths.max())
    if max_len == 0:
        return None
    keys, values, key_valid = gather_stream(sub_stream, max_len)
    visible = key_valid[:, None, :]
    if q_positions is None:
        visible = visible.expand(-1, group.rows.shape[1], -1)
    else:
        key_positions, block_ends = _key_positions(sub_stream, max_len)
        positions = q_positions.long()[group.rows][:, :, None]
        visible = visible & (key_positions[:, None, :] <= positions)
        if stream.shown_from is not None:
            visible = visible & (positions >= block_ends[:, None, :] + stream.shown_from)
        if stream.hidden_from is not None:
            visible = visible & (positions < block_ends[:, None, :] + stream.hidden_from)
    visible = visible[:, None]
    if stream.query_mask is not None:
        visible = visible & stream.query_mask[group.rows][..., :max_len].transpose(1, 2)
    return GroupKeys(keys, values, visible)


def _additive_mask(visible: torch.Tensor, logit_bias: float) -> torch.Tensor:
    """-inf where a key is hidden, the stream's logit bias where it is visible."""
    return torch.full(visible.shape, -math.inf, device=visible.device).masked_fill(
        visible, logit_bias
    )


def cache_attention_torch(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    streams: Sequence[PagedStream],
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """out fp32 [Nq, Hq, D] over all streams of each sequence's cache at once.

    The streams' vectors are gathered side by side, each with its own logit bias in the mask,
    and torch's fused scaled_dot_product_attention runs one softmax over all of them: the same
    result as attending each stream and merging by log-sum-exp, without materialising the
    logits (the per-stream path spent a third of a CSA prefill in logsumexp and exp). A decode
    step on a CPU runs the fused C kernel where it serves every stream
    (`kvtune.kernels.native.decode_attention`), else dequantizes straight into SDPA's layout
    (`decode_attention_torch`, the reference).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if q_positions is None:
        fused = decode_attention_native(q, q_seq_starts, streams, scale)
        if fused is not None:
            return fused
        return decode_attention_torch(q, q_seq_starts, merge_decode_streams(streams), scale)
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for group in query_groups(q_seq_starts):
        parts = [(group_keys(stream, group, q_positions), stream.logit_bias) for stream in streams]
        parts = [(gathered, bias) for gathered, bias in parts if gathered is not None]
        if not parts:
            continue
        # Concatenated straight into SDPA's [S, Hkv, L, D] layout: the same one copy, and SDPA
        # then reads contiguous rows (strided keys and values made it about 1.3x slower on a CPU).
        keys = torch.cat([gathered.keys.transpose(1, 2) for gathered, _ in parts], dim=2)
        values = torch.cat([gathered.values.transpose(1, 2) for gathered, _ in parts], dim=2)
        heads = max(gathered.visible.shape[1] for gathered, _ in parts)
        mask = torch.cat(
            [
                _additive_mask(gathered.visible, bias).expand(-1, heads, -1, -1)
                for gathered, bias in parts
            ],
            -1,
        )
        if heads > 1:  # per KV head: each query head takes its KV head's mask
            mask = mask.repeat_interleave(num_q_heads // heads, dim=1)
        group_out = F.scaled_dot_product_attention(
            q[group.rows].float().transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        # A sequence without visible keys yields NaN from SDPA; its output stays 0.
        out[group.rows.flatten()] = group_out.flatten(0, 1).nan_to_num(0.0)
    return out
