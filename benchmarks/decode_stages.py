"""Where quantized decode spends its time: the paged cache read three ways, in one run.

The first H200 run (RESULTS.md, "Kernels on an H200") found fp8 and fp4 decode 3-9x slower than
fp16 once the dots are tf32, at 1-4% of the copy bandwidth. This benchmark separates the
suspects: for each format, over the same shuffled blocks and with the decode kernel's grid
(sequence, KV head, split), it times

    bytes      every code and scale byte of K and V read as whole, contiguous rows and summed
               (the paging and the bytes, with nothing decoded);
    dequant    K and V tiles through `load_dequant_tile`, the attention kernel's own reader
               (loads as it addresses them, decodes, scales), summed;
    attention  the decode kernel itself (`decode_attention`, tf32 dots on a GPU).

dequant / bytes is what decoding costs; attention / dequant what the softmax, the dots and
their layouts add.

    python -m benchmarks.decode_stages                      # CUDA: batch 32 x 32K
    python -m benchmarks.decode_stages --smoke --device cpu # interpreter, toy sizes (checks only)
"""

from __future__ import annotations

import argparse
import os

import torch
import triton
import triton.language as tl
from rich.console import Console

from benchmarks.kernels import FORMATS, Shape, copy_bandwidth_gbps, kv_bytes, random_stream, time_ms
from benchmarks.tables import print_rows
from kvtune.kernels.attention.decode import decode_attention, default_num_splits
from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import read_vectors_ref
from kvtune.kernels.formats.quantize import format_switches, load_dequant_tile

BLOCK_N = tl.constexpr(64)  # keys a loop iteration reads, as the decode kernel's tiles
STAGES = ("bytes", "dequant", "attention")


@triton.jit
def _pair_bytes(k_ptr, v_ptr, vectors, valid, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Sum [len(vectors)] of the WIDTH bytes of each vector in both buffers, read as rows."""
    columns = tl.arange(0, BLOCK)
    mask = valid[:, None] & (columns[None, :] < WIDTH)
    offsets = vectors[:, None] * WIDTH + columns[None, :]
    k = tl.load(k_ptr + offsets, mask=mask, other=0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0).to(tl.float32)
    return tl.sum(k + v, axis=1)


@triton.jit
def _stage_kernel(
    k_codes_ptr,
    k_scales_ptr,
    k_tensor_scale_ptr,
    v_codes_ptr,
    v_scales_ptr,
    v_tensor_scale_ptr,
    block_table_ptr,
    stride_block_table,
    length,
    num_splits,
    out_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CODE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    DEQUANT: tl.constexpr,
    K_CODE: tl.constexpr,
    K_GROUP_SIZE: tl.constexpr,
    K_SCALE_DTYPE: tl.constexpr,
    K_TOKEN_GROUP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_GROUP_SIZE: tl.constexpr,
    V_SCALE_DTYPE: tl.constexpr,
    V_TOKEN_GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (sequence, KV head, split) program: the split's keys read as `DEQUANT` says, summed
    into out[program] so that no load can be dropped."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    key_end = tl.minimum(length, split * split_len + split_len)
    dims = tl.arange(0, BLOCK_D)
    total = tl.zeros([BLOCK_N], tl.float32)
    for key_tile in range(split * split_len, key_end, BLOCK_N):
        keys = key_tile + tl.arange(0, BLOCK_N)
        key_valid = keys < key_end
        row = block_table_ptr + seq.to(tl.int64) * stride_block_table
        blocks = tl.load(row + keys // BLOCK_SIZE, mask=key_valid, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        if DEQUANT:
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
            total += tl.sum(k + v, axis=1)
        else:
            vectors = slots * NUM_KV_HEADS + kv_head
            total += _pair_bytes(k_codes_ptr, v_codes_ptr, vectors, key_valid, CODE_BYTES, BLOCK_B)
            if SCALE_BYTES > 0:
                total += _pair_bytes(
                    k_scales_ptr, v_scales_ptr, vectors, key_valid, SCALE_BYTES, BLOCK_S
                )
    program = (seq * NUM_KV_HEADS + kv_head) * tl.num_programs(2) + split
    tl.store(out_ptr + program, tl.sum(total))


def _byte_view(buffer: torch.Tensor | None) -> torch.Tensor | None:
    """Codes and scales as flat bytes (fp16 codes: their two bytes each)."""
    return None if buffer is None else buffer.view(torch.uint8).flatten()


def read_stage(stream: PagedStream, length: int, dequant: bool, num_splits: int) -> torch.Tensor:
    """Launch the `bytes` (dequant False) or `dequant` reader over every sequence's keys."""
    k, v = stream.k, stream.v
    code_bytes = k.codes[0, 0, 0].numel() * k.codes.element_size()
    scale_bytes = 0 if k.scales is None else k.scales[0, 0, 0].numel() * k.scales.element_size()
    if dequant:  # the attention kernel's own pointers and dtypes
        k_codes, v_codes, k_scales, v_scales = k.codes, v.codes, k.scales, v.scales
    else:
        k_codes, v_codes = _byte_view(k.codes), _byte_view(v.codes)
        k_scales, v_scales = _byte_view(k.scales), _byte_view(v.scales)
    num_seqs, num_heads = stream.num_seqs, k.num_heads
    out = torch.empty(num_seqs * num_heads * num_splits, device=k.codes.device)
    _stage_kernel[(num_seqs, num_heads, num_splits)](
        k_codes,
        k_scales if k_scales is not None else k_codes,
        k.tensor_scale,
        v_codes,
        v_scales if v_scales is not None else v_codes,
        v.tensor_scale,
        stream.block_table,
        stream.block_table.stride(0),
        length,
        num_splits,
        out,
        NUM_KV_HEADS=num_heads,
        HEAD_DIM=k.head_dim,
        BLOCK_SIZE=k.block_size,
        CODE_BYTES=code_bytes,
        SCALE_BYTES=scale_bytes,
        DEQUANT=dequant,
        BLOCK_D=triton.next_power_of_2(k.head_dim),
        BLOCK_B=triton.next_power_of_2(code_bytes),
        BLOCK_S=triton.next_power_of_2(max(1, scale_bytes)),
        **format_switches(k.fmt, "K_"),
        **format_switches(v.fmt, "V_"),
    )
    return out


def check_reads(stream: PagedStream, context: int, splits: int) -> None:
    """Both readers cover every stored vector once: their sums against torch's (every block of
    the stream is in use), within fp32 summation error (1e-4 of the sum of magnitudes)."""
    slots = torch.arange(stream.k.num_slots, device=stream.k.codes.device)
    pools = (stream.k, stream.v)
    read = {
        False: [
            _byte_view(b).double() for p in pools for b in (p.codes, p.scales) if b is not None
        ],
        True: [read_vectors_ref(pool, slots).double() for pool in pools],
    }
    for dequant, parts in read.items():
        total = sum(float(part.sum()) for part in parts)
        magnitude = sum(float(part.abs().sum()) for part in parts)
        got = float(read_stage(stream, context, dequant, splits).double().sum())
        if abs(got - total) > 1e-4 * magnitude:
            raise AssertionError(f"{stream.k.fmt} dequant={dequant}: read {got}, expected {total}")


def measure(name: str, batch: int, context: int, shape: Shape, device: str, iterations: int):
    """(stage, ms) of one format, and the bytes decode reads."""
    stream = random_stream(FORMATS[name], shape, batch, context, 1, 0.0, device)
    splits = default_num_splits(batch, shape.num_kv_heads)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device=device)
    precision = "tf32" if device == "cuda" else "ieee"
    check_reads(stream, context, splits)
    runs = {
        "bytes": lambda: read_stage(stream, context, False, splits),
        "dequant": lambda: read_stage(stream, context, True, splits),
        "attention": lambda: decode_attention(q, stream, shape.head_dim**-0.5, splits, precision),
    }
    times = {stage: time_ms(run, iterations, device) for stage, run in runs.items()}
    return times, kv_bytes(FORMATS[name], shape, batch * context)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="batch 2 x 128 keys, 1 iteration")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernels interpreted: set TRITON_INTERPRET=1")
    batch, context, iterations = args.batch, args.context, args.iterations
    shape = Shape()
    if args.smoke:
        batch, context, iterations, shape = 2, 128, 1, Shape(8, 2, 64, 16)
    copy = copy_bandwidth_gbps(args.device, iterations)
    lines = []
    for name in FORMATS:
        times, read = measure(name, batch, context, shape, args.device, iterations)
        for stage in STAGES:
            gbps = read / times[stage] / 1e6
            lines.append(
                [
                    name,
                    stage,
                    f"{times[stage]:.3f}",
                    f"{gbps:.0f} ({gbps / copy:.0%})",
                    f"{times[stage] / times['bytes']:.2f}",
                ]
            )
    console = Console()
    console.print(
        f"decode stages on {args.device}, batch {batch} x {context} keys, "
        f"{shape.num_kv_heads} KV heads x {shape.head_dim}, device copy {copy:.0f} GB/s"
    )
    headers = ["format", "stage", "median ms", "KV GB/s (of copy)", "vs bytes"]
    print_rows(headers, lines, args.markdown, console)


if __name__ == "__main__":
    main()
