"""The CPU kernel of a decode step's attention over every stream of the step (decode_attention.c):
codes, scales and zero points read and decoded in registers, online softmax, no fp32 copy of the
cache and one call for all sequences and streams. The torch path
(`kvtune.kernels.attention.decode_torch`) stays the reference; this gives the same result to
float rounding (another summation order), and each sequence's output has the same bits whatever
else the batch holds."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvtune.kernels.native.build import load_kernel
from kvtune.kernels.native.pool_codes import PoolCodes, pool_codes

if TYPE_CHECKING:
    from kvtune.kernels.attention.paged import PagedStream

SOURCE = Path(__file__).with_suffix(".c")
MAX_GROUP = 16  # decode_attention.c's MAX_GROUP: query heads a KV head serves
MAX_DIM = 512  # decode_attention.c's MAX_DIM
# Vectors of a sequence one thread reads before its partial softmax is merged: few enough that
# a batch of one (a few KV heads) keeps every core busy, many enough that merging costs little.
SPLIT_TOKENS = 256


class _DecodeStream(ctypes.Structure):
    """decode_attention.c's DecodeStream, field for field."""

    _fields_ = [
        ("k", PoolCodes),
        ("v", PoolCodes),
        ("table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("lengths", ctypes.c_void_p),
        ("query_mask", ctypes.c_void_p),
        ("mask_seq", ctypes.c_int64),
        ("mask_head", ctypes.c_int64),
        ("mask_len", ctypes.c_int64),
        ("logit_bias", ctypes.c_float),
    ]


class _DecodeArgs(ctypes.Structure):
    """decode_attention.c's DecodeArgs, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_seq", ctypes.c_int64),
        ("q_head", ctypes.c_int64),
        ("seqs", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("split_blocks", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_seq", ctypes.c_int64),
        ("out_head", ctypes.c_int64),
    ]


def _int32_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """tensor as int32 on the CPU with contiguous rows, as the kernel indexes it."""
    if tensor.dtype != torch.int32 or tensor.device.type != "cpu" or tensor.stride(-1) != 1:
        return tensor.to("cpu", torch.int32).contiguous()
    return tensor


def _stream_args(
    stream: PagedStream, kv_heads: int, head_dim: int, keep: list[torch.Tensor]
) -> _DecodeStream | None:
    """A stream as the kernel reads it, or None where the kernel does not serve it; keep
    collects the tensors whose memory the call reads."""
    k, v = pool_codes(stream.k), pool_codes(stream.v)
    if k is None or v is None or stream.num_kv_heads != kv_heads or stream.head_dim != head_dim:
        return None
    table, lengths = _int32_cpu(stream.block_table), _int32_cpu(stream.lengths)
    if table.shape[1] * stream.block_size < int(lengths.max()):
        raise ValueError(
            f"block_table: {table.shape[1]} blocks a sequence cannot hold {int(lengths.max())} "
            f"vectors in blocks of {stream.block_size}"
        )
    keep += [table, lengths]
    args = _DecodeStream(
        k=k,
        v=v,
        table=table.data_ptr(),
        table_stride=table.stride(0),
        lengths=lengths.data_ptr(),
        logit_bias=stream.logit_bias,
    )
    mask = stream.query_mask
    if mask is not None:
        if mask.shape[0] != stream.num_seqs:  # not one query a sequence
            return None
        if mask.device.type != "cpu" or mask.stride(-1) != 1:
            mask = mask.to("cpu").contiguous()
        keep.append(mask)
        args.query_mask = mask.data_ptr()
        args.mask_seq, args.mask_head = mask.stride(0), mask.stride(1)
        args.mask_len = mask.shape[2]
    return args


def _one_query_a_sequence(q_seq_starts: torch.Tensor, seqs: int) -> bool:
    starts = q_seq_starts.tolist()
    return starts == list(range(seqs + 1))


def decode_attention_native(
    q: torch.Tensor,
    q_seq_starts: torch.Tensor,
    streams: Sequence[PagedStream],
    scale: float,
    split_tokens: int = SPLIT_TOKENS,
) -> torch.Tensor | None:
    """out fp32 [N, Hq, D] of decode queries q [N, Hq, D], query i that of sequence i
    (q_seq_starts 0, 1, ..., N), each seeing every stored vector of its streams within the
    stream's query_mask and with its logit bias (`decode_attention_torch`'s contract); a query
    head that sees nothing gets 0. split_tokens: about how many vectors of a sequence one
    thread reads. None, having done nothing, where the kernel does not apply (a pool off the
    CPU or of a format its decoder lacks, not one query a sequence) or is not built."""
    library = load_kernel(SOURCE)
    if library is None or q.device.type != "cpu" or not streams or not len(q):
        return None
    seqs, num_q_heads, head_dim = q.shape
    kv_heads = streams[0].num_kv_heads
    group = num_q_heads // kv_heads
    if (
        group > MAX_GROUP
        or head_dim > MAX_DIM
        or group * kv_heads != num_q_heads
        or not _one_query_a_sequence(q_seq_starts, seqs)
        or any(stream.num_seqs != seqs for stream in streams)
    ):
        return None
    keep: list[torch.Tensor] = []
    stream_args = (_DecodeStream * len(streams))()
    for i, stream in enumerate(streams):
        args = _stream_args(stream, kv_heads, head_dim, keep)
        if args is None:
            return None
        stream_args[i] = args
    queries = q.float().contiguous()
    out = torch.empty(seqs, num_q_heads, head_dim)
    args = _DecodeArgs(
        q=queries.data_ptr(),
        q_seq=queries.stride(0),
        q_head=queries.stride(1),
        seqs=seqs,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        scale=scale,
        split_blocks=max(1, split_tokens // streams[0].block_size),
        out=out.data_ptr(),
        out_seq=out.stride(0),
        out_head=out.stride(1),
    )
    failed = library.kvtune_decode_attention(
        ctypes.byref(args), stream_args, ctypes.c_int64(len(streams))
    )
    if failed == 1:
        raise IndexError("block_table: a block id a sequence reads lies outside its pool")
    if failed:
        raise MemoryError("decode attention: its partial results could not be allocated")
    return out
