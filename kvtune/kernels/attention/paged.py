"""Attention of query tokens over one paged K/V stream, dequantizing the cache inside the kernel.

A sequence's KV cache is one or more *streams* (exact tokens, CSA sinks / summaries / window,
an fp16 recent window ...). Attention over the sequence is one softmax over the union of its
streams; each stream's kernel returns its partial output with the log-sum-exp (LSE) of its
logits, and `kvtune.kernels.attention.merge` merges the partials. Decode (one query a sequence,
split-KV) lives in `kvtune.kernels.attention.decode` and reuses the kernel defined here.

One kernel serves every cache format: element dtype (fp32/fp16/bf16 as stored, fp8 E4M3, fp4
E2M1), group size and scale dtype are constexpr switches, so there are no per-dtype copies.
Each program takes one KV head and a tile of rows, a row being one (query token, query head of
that KV head) pair, so a K/V tile is loaded once for all GQA query heads that share it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtune.kernels.cache.pool import KVPool, read_vectors_ref
from kvtune.kernels.formats.quantize import format_switches, load_dequant_tile

LOG2_E = 1.4426950408889634
LN_2 = tl.constexpr(0.6931471805599453)  # used inside the kernel: must be constexpr
# Stand-ins for "no bound" on a vector's lifetime: far past any position, still int32.
ALWAYS = -(2**30)
NEVER = 2**30
DOT_PRECISIONS = ("ieee", "tf32")


@dataclass(frozen=True)
class PagedStream:
    """One paged set of K/V sequences stored in one pair of pools.

    block_table: int32 [num_seqs, max_blocks], pool block id of each logical block.
    lengths: int32 [num_seqs], vectors stored per sequence (tokens, or summaries).
    start_positions: int32 [num_seqs], absolute token position of each sequence's vector 0.
    position_stride: tokens a stored vector stands for (1 for exact tokens, r for CSA
        summaries). Vector i covers positions start + i*r ... start + i*r + r - 1 and is causally
        visible from its last position.
    logit_bias: added to every logit of this stream (0, or ln r for summaries, so that a group of
        r identical keys gets exactly the mass of its r tokens).
    shown_from, hidden_from: lifetime of the vectors, in tokens after the end of each vector's
        source block (the block_size positions it lies in, or the block a summary was pooled
        from; a stream's last block ends where the stream ends). A query at position p sees a
        vector only when block_end + shown_from <= p < block_end + hidden_from (None: no bound).
        A prefill chunk holds a block that is demoted or compressed within the chunk in both
        forms, each shown to the positions that decode would show it to, so every position
        sees exactly the cache of a decode step there. Decode ignores lifetimes: its cache is
        already in that state.
    query_mask: bool [num packed queries, num_kv_heads, >= longest length], or None: which
        vectors each query may see, per KV head, besides the rules above (CSA selection: a
        query reads the exact form of the blocks it selected and the summaries of the others).
    """

    k: KVPool
    v: KVPool
    block_table: torch.Tensor
    lengths: torch.Tensor
    start_positions: torch.Tensor
    position_stride: int = 1
    logit_bias: float = 0.0
    shown_from: int | None = None
    hidden_from: int | None = None
    query_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("block_table", "lengths", "start_positions"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int32:
                raise ValueError(f"{name}.dtype={tensor.dtype}: must be torch.int32")
        if self.block_table.dim() != 2:
            raise ValueError(f"block_table.shape={tuple(self.block_table.shape)}: must be 2-D")
        num_seqs = self.block_table.shape[0]
        for name in ("lengths", "start_positions"):
            if tuple(getattr(self, name).shape) != (num_seqs,):
                raise ValueError(
                    f"{name}.shape={tuple(getattr(self, name).shape)}: must be ({num_seqs},)"
                )
        if self.position_stride < 1:
            raise ValueError(f"position_stride={self.position_stride}: must be >= 1")
        mask = self.query_mask
        if mask is not None and (
            mask.dtype != torch.bool or mask.dim() != 3 or mask.shape[1] != self.num_kv_heads
        ):
            raise ValueError(
                f"query_mask: must be bool [queries, {self.num_kv_heads} KV heads, length], got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
        k_layout = (*self.k.codes.shape[:3], self.k.head_dim)
        v_layout = (*self.v.codes.shape[:3], self.v.head_dim)
        if k_layout != v_layout:
            raise ValueError(
                f"k pool [blocks, block_size, heads, head_dim]={k_layout} and v pool {v_layout}: "
                "must match"
            )

    @property
    def lifetime(self) -> tuple[int, int]:
        """(shown_from, hidden_from) with ALWAYS / NEVER standing in for no bound."""
        shown = ALWAYS if self.shown_from is None else self.shown_from
        hidden = NEVER if self.hidden_from is None else self.hidden_from
        return shown, hidden

    @property
    def num_seqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.k.num_heads

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    def select(self, seqs: torch.Tensor) -> PagedStream:
        """The same pools seen by a subset of the sequences (indices into the batch)."""
        return dataclasses.replace(
            self,
            block_table=self.block_table[seqs],
            lengths=self.lengths[seqs],
            start_positions=self.start_positions[seqs],
        )


@triton.jit
def _stream_attention_kernel(
    q_ptr,
    q_positions_ptr,
    q_seq_starts_ptr,
    k_codes_ptr,
    k_scales_ptr,
    k_tensor_scale_ptr,
    v_codes_ptr,
    v_scales_ptr,
    v_tensor_scale_ptr,
    block_table_ptr,
    lengths_ptr,
    start_positions_ptr,
    query_mask_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    bias_log2,
    position_stride,
    shown_from,
    hidden_from,
    num_splits,
    stride_q_token,
    stride_q_head,
    stride_block_table,
    stride_mask_token,
    stride_mask_head,
    stride_out_split,
    stride_lse_split,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    K_CODE: tl.constexpr,
    K_GROUP_SIZE: tl.constexpr,
    K_SCALE_DTYPE: tl.constexpr,
    K_TOKEN_GROUP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_GROUP_SIZE: tl.constexpr,
    V_SCALE_DTYPE: tl.constexpr,
    V_TOKEN_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Partial attention of one row tile x one KV split of one sequence and KV head.

    Grid: (num_seqs, num_kv_heads, row_tiles * num_splits). Writes out [split, token, head, D]
    and its natural-log LSE; rows that see no key get out 0 and lse -inf.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row_tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    group: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS

    q_start = tl.load(q_seq_starts_ptr + seq)
    q_len = tl.load(q_seq_starts_ptr + seq + 1) - q_start
    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len * group
    tokens = (q_start + rows // group).to(tl.int64)
    heads = kv_head * group + rows % group
    dims = tl.arange(0, BLOCK_D)
    q_offsets = tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q_mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)

    length = tl.load(lengths_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    key_begin = split * split_len
    key_end = tl.minimum(length, key_begin + split_len)
    key_start_position = tl.load(start_positions_ptr + seq)
    if CAUSAL:
        q_positions = tl.load(q_positions_ptr + tokens, mask=row_valid, other=0)
        # Key i is visible from position start + i*stride + stride - 1 on: keys past the
        # tile's last query position are never loaded.
        last = tl.max(tl.where(row_valid, q_positions, -1)) - key_start_position
        visible = last - position_stride + 1
        key_end = tl.minimum(key_end, tl.where(visible >= 0, visible // position_stride + 1, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    for key_tile in range(key_begin, key_end, BLOCK_N):
        keys = key_tile + tl.arange(0, BLOCK_N)
        key_valid = keys < key_end
        blocks = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        k = load_dequant_tile(
            k_codes_ptr,
            k_scales_ptr,
            k_tensor_scale_ptr,
            slots,
            kv_head,
            key_valid,
            dims,
            NUM_KV_HEADS,
            HEAD_DIM,
            K_CODE,
            K_GROUP_SIZE,
            K_SCALE_DTYPE,
            K_TOKEN_GROUP,
        )
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2 + bias_log2
        seen = row_valid[:, None] & key_valid[None, :]
        if CAUSAL:
            key_positions = key_start_position + keys * position_stride + position_stride - 1
            seen = seen & (key_positions[None, :] <= q_positions[:, None])
            block_ends = key_start_position + tl.minimum(
                (keys * position_stride // BLOCK_SIZE + 1) * BLOCK_SIZE, length * position_stride
            )
            seen = seen & (q_positions[:, None] >= block_ends[None, :] + shown_from)
            seen = seen & (q_positions[:, None] < block_ends[None, :] + hidden_from)
        if MASKED:  # CSA selection: which keys each query token may read, per KV head
            mask_rows = tokens * stride_mask_token + kv_head * stride_mask_head
            allowed = tl.load(
                query_mask_ptr + mask_rows[:, None] + keys[None, :], mask=seen, other=0
            )
            seen = seen & (allowed != 0)
        logits = tl.where(seen, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_dequant_tile(
            v_codes_ptr,
            v_scales_ptr,
            v_tensor_scale_ptr,
            slots,
            kv_head,
            key_valid,
            dims,
            NUM_KV_HEADS,
            HEAD_DIM,
            V_CODE,
            V_GROUP_SIZE,
            V_SCALE_DTYPE,
            V_TOKEN_GROUP,
        )
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN_2, float("-inf"))
    out_rows = split * stride_out_split + (tokens * NUM_Q_HEADS + heads) * HEAD_DIM
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out, mask=q_mask)
    lse_rows = split * stride_lse_split + tokens * NUM_Q_HEADS + heads
    tl.store(lse_ptr + lse_rows, lse, mask=row_valid)


def paged_attention_partials(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int,
    num_splits: int,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the stream kernel; returns per-split partials out [S, Nq, Hq, D], lse [S, Nq, Hq].

    q_positions None means no causal mask (every stored key is visible, as in decode). Keys are
    split into num_splits contiguous ranges per sequence, to be merged by LSE. dot_precision:
    "ieee" (fp32 products) or "tf32" (tensor cores on a GPU: 10-bit mantissas in q.k and p.v).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim != stream.head_dim or q.stride(-1) != 1:
        raise ValueError(
            f"q.shape={tuple(q.shape)}: head_dim must be {stream.head_dim} and unit-strided"
        )
    if num_q_heads % stream.num_kv_heads:
        raise ValueError(
            f"num_q_heads={num_q_heads}: must be a multiple of num_kv_heads={stream.num_kv_heads}"
        )
    if tuple(q_seq_starts.shape) != (stream.num_seqs + 1,) or q_seq_starts.dtype != torch.int32:
        raise ValueError(f"q_seq_starts: must be int32 of shape ({stream.num_seqs + 1},)")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}: must be >= 1")
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision={dot_precision!r}: one of {', '.join(DOT_PRECISIONS)}")
    out = q.new_empty(num_splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    lse = q.new_empty(num_splits, num_tokens, num_q_heads, dtype=torch.float32)
    group = num_q_heads // stream.num_kv_heads
    block_m = max(16, min(64, triton.next_power_of_2(max(1, max_q_len * group))))
    row_tiles = triton.cdiv(max_q_len * group, block_m)
    if num_tokens == 0 or row_tiles == 0:
        return out, lse
    shown_from, hidden_from = stream.lifetime
    mask = stream.query_mask
    if mask is not None and (mask.shape[0] != num_tokens or mask.stride(-1) != 1):
        raise ValueError(f"query_mask: must be unit-strided [{num_tokens}, Hkv, length]")
    mask_bytes = None if mask is None else mask.view(torch.uint8)
    grid = (stream.num_seqs, stream.num_kv_heads, row_tiles * num_splits)
    _stream_attention_kernel[grid](
        q,
        q_positions if q_positions is not None else q_seq_starts,
        q_seq_starts,
        # A format without group scales never reads its scales pointer: pass the codes.
        stream.k.codes,
        stream.k.scales if stream.k.scales is not None else stream.k.codes,
        stream.k.tensor_scale,
        stream.v.codes,
        stream.v.scales if stream.v.scales is not None else stream.v.codes,
        stream.v.tensor_scale,
        stream.block_table,
        stream.lengths,
        stream.start_positions,
        mask_bytes if mask_bytes is not None else stream.lengths,
        out,
        lse,
        scale * LOG2_E,
        stream.logit_bias * LOG2_E,
        stream.position_stride,
        shown_from,
        hidden_from,
        num_splits,
        q.stride(0),
        q.stride(1),
        stream.block_table.stride(0),
        mask.stride(0) if mask is not None else 0,
        mask.stride(1) if mask is not None else 0,
        out.stride(0),
        lse.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=stream.num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=stream.block_size,
        CAUSAL=q_positions is not None,
        MASKED=mask is not None,
        **format_switches(stream.k.fmt, "K_"),
        **format_switches(stream.v.fmt, "V_"),
        DOT_PRECISION=dot_precision,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out, lse


def stream_attention(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
    dot_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of packed query chunks over one stream (prefill / extend).

    q: [Nq, Hq, D] query tokens of all sequences, packed; q_positions: int32 [Nq] absolute
    positions; q_seq_starts: int32 [num_seqs + 1] cumulative query counts (cu_seqlens). Query
    head h reads KV head h // (Hq / Hkv). A key is visible when its position <= the query's.
    max_q_len: longest query chunk, if known, saves a device-to-host sync.
    Returns out fp32 [Nq, Hq, D] and lse fp32 [Nq, Hq] (natural log; -inf with out 0 for a
    query that sees no key).
    """
    if max_q_len is None:
        max_q_len = int((q_seq_starts[1:] - q_seq_starts[:-1]).max().item()) if len(q) else 0
    if q_positions.dtype != torch.int32 or tuple(q_positions.shape) != (q.shape[0],):
        raise ValueError(f"q_positions: must be int32 of shape ({q.shape[0]},)")
    out, lse = paged_attention_partials(
        q, q_positions, q_seq_starts, stream, scale, max_q_len, 1, dot_precision
    )
    return out[0], lse[0]


def stream_vectors_ref(
    stream: PagedStream, seq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense fp32 K, V [L, Hkv, D] of one sequence, the causal position of each vector [L] and
    the end of its source block [L] (PagedStream's lifetime rule counts from there)."""
    length = int(stream.lengths[seq])
    indices = torch.arange(length, device=stream.block_table.device)
    blocks = stream.block_table[seq, indices // stream.block_size].long()
    slots = blocks * stream.block_size + indices % stream.block_size
    k = read_vectors_ref(stream.k, slots)
    v = read_vectors_ref(stream.v, slots)
    stride, start = stream.position_stride, int(stream.start_positions[seq])
    positions = start + indices * stride + stride - 1
    first_tokens = indices * stride
    source_block_ends = (first_tokens - first_tokens % stream.block_size) + stream.block_size
    block_ends = start + source_block_ends.clamp(max=length * stride)
    return k, v, positions, block_ends


def paged_attention_ref(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `paged_attention_partials` after merging: one sequence at a time, in fp32."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // stream.num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    for seq in range(stream.num_seqs):
        begin, end = int(q_seq_starts[seq]), int(q_seq_starts[seq + 1])
        k, v, key_positions, block_ends = stream_vectors_ref(stream, seq)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,khd->htk", q[begin:end].float(), k) * scale
        logits = logits + stream.logit_bias
        if q_positions is not None:
            seq_positions = q_positions[begin:end, None]
            shown_from, hidden_from = stream.lifetime
            visible = (
                (key_positions[None, :] <= seq_positions)
                & (seq_positions >= block_ends[None, :] + shown_from)
                & (seq_positions < block_ends[None, :] + hidden_from)
            )
            logits = logits.masked_fill(~visible[None], -math.inf)
        seq_lse = torch.logsumexp(logits, dim=-1)
        # A query that sees no key has lse -inf: give it zero weights, not NaN.
        weights = torch.exp(logits - seq_lse[..., None])
        weights = torch.where(seq_lse[..., None] == -math.inf, 0.0, weights)
        out[begin:end] = torch.einsum("htk,khd->thd", weights, v)
        lse[begin:end] = seq_lse.transpose(0, 1)
    return out, lse


def stream_attention_ref(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    q_seq_starts: torch.Tensor,
    stream: PagedStream,
    scale: float,
    max_q_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `stream_attention` (max_q_len only matters to the kernel launch)."""
    return paged_attention_ref(q, q_positions, q_seq_starts, stream, scale)
