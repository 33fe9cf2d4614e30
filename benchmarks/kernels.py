"""Decode-attention benchmark: paged fp16 / fp8 / fp4 caches, with and without CSA compression.

Decode is memory-bound, so each row reports the KV bytes read, the achieved bandwidth, that
bandwidth as a share of a plain device copy measured in the same run, and the speed-up over the
fp16 paged kernel and over `F.scaled_dot_product_attention` on a dense fp16 cache.

    python -m benchmarks.kernels                  # CUDA: full grid (batch 1/8/32, 4K/32K/128K)
    python -m benchmarks.kernels --smoke          # a small grid; on CPU, the torch paths

Each (batch, context) also times CSA selection's decode scoring: every query head's Quest bound
against a separate int4 key-bounds index of one vector a block (what a selecting decode step
reads besides the blocks it picks), so "vs fp16 paged" is its cost against dense attention.

On CUDA it times the `triton_tf32` backend's kernels. On CPU (no CUDA, or --device cpu) the
runtime's `torch` backend (all streams in one SDPA call) runs on a tiny grid instead of the
Triton kernels (no interpreter), so that the table and its columns can be checked anywhere.
Run benchmarks as modules (`python -m benchmarks.NAME`): as a script, this file's name would
shadow `kernels`.
"""

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from kvtune.kernels.cache.pool import KVPool
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.selection.blocks import index_products_torch
from kvtune.runtime.backends import cache_ops
from kvtune.runtime.kv_bytes import index_format

FORMATS = {
    "fp16": KVFormat("fp16"),
    "fp8": KVFormat("fp8"),
    "fp4": KVFormat("fp4", 16, "e4m3"),
}


@dataclass(frozen=True)
class Shape:
    """Attention geometry of one layer (defaults: a Llama-3-8B layer) and paging."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class Compression:
    """CSA layout: sinks and window exact, the middle pooled `ratio` tokens to one summary."""

    ratio: int = 4
    sinks: int = 16
    window: int = 1024

    def stream_lengths(self, context: int) -> list[tuple[int, int, float]]:
        """(vectors stored, position stride, logit bias) of the sinks, summary, window streams."""
        sinks = min(self.sinks, context)
        window = min(self.window, context - sinks)
        summaries = math.ceil((context - sinks - window) / self.ratio)
        return [(sinks, 1, 0.0), (summaries, self.ratio, math.log(self.ratio)), (window, 1, 0.0)]


@dataclass(frozen=True)
class Grid:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    compression: Compression
    iterations: int


GRIDS = {
    "cuda": Grid((1, 8, 32), (4096, 32768, 131072), Compression(), 20),
    "cuda-smoke": Grid((1, 8), (4096, 32768), Compression(), 5),
    "cpu": Grid((1, 2), (256, 1024), Compression(ratio=4, sinks=4, window=128), 2),
    "cpu-smoke": Grid((1,), (256,), Compression(ratio=4, sinks=4, window=128), 1),
}


@dataclass
class Row:
    """One measured (or skipped) configuration."""

    method: str
    batch: int
    context: int
    ms: float = math.nan
    kv_bytes: int = 0
    note: str = ""


def random_stream(
    fmt: KVFormat, shape: Shape, batch: int, length: int, stride: int, bias: float, device: str
) -> PagedStream:
    """A stream of `batch` sequences of `length` vectors in shuffled blocks, random valid codes."""
    blocks_per_seq = max(1, math.ceil(length / shape.block_size))
    num_blocks = batch * blocks_per_seq
    pools = []
    for _ in range(2):
        pool = KVPool.allocate(
            fmt,
            num_blocks,
            shape.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            torch.tensor([0.05], device=device),
            device,
        )
        if fmt.dtype == "fp8":
            pool.codes.random_(0, 0x60)  # E4M3 magnitudes up to 16, no NaN code
        elif fmt.quantized:
            pool.codes.random_(0, 256)  # every E2M1 byte is valid
        else:
            pool.codes.normal_()
        if pool.scales is not None:
            pool.scales.fill_(0x38 if fmt.scale_dtype == "e4m3" else 1.0)  # E4M3 0x38 = 1.0
        pools.append(pool)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    return PagedStream(
        k=pools[0],
        v=pools[1],
        block_table=order.view(batch, blocks_per_seq),
        lengths=torch.full((batch,), length, dtype=torch.int32, device=device),
        start_positions=torch.zeros(batch, dtype=torch.int32, device=device),
        position_stride=stride,
        logit_bias=bias,
    )


def kv_bytes(fmt: KVFormat, shape: Shape, vectors: int) -> int:
    """Bytes of K and V codes and scales that decode reads for `vectors` cached vectors."""
    return 2 * vectors * shape.num_kv_heads * fmt.vector_bytes(shape.head_dim)


def stream_layout(grid: Grid, compressed: bool, context: int) -> list[tuple[int, int, float]]:
    """(vectors, position stride, logit bias) of each stream a sequence of `context` tokens uses."""
    return grid.compression.stream_lengths(context) if compressed else [(context, 1, 0.0)]


def method_name(name: str, compressed: bool, grid: Grid) -> str:
    return f"{name} paged" + (f" + CSA {grid.compression.ratio}" if compressed else "")


def allocated_bytes(fmt: KVFormat, shape: Shape, batch: int, layout: list) -> int:
    """Device memory the pools of one configuration take, blocks rounded up."""
    blocks = sum(max(1, math.ceil(length / shape.block_size)) for length, _, _ in layout)
    return kv_bytes(fmt, shape, batch * blocks * shape.block_size)


def time_ms(fn: Callable[[], object], iterations: int, device: str) -> float:
    """Median wall time of fn in ms (CUDA events on GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(iterations):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(device: str, iterations: int) -> float:
    """Achieved bandwidth of a device-to-device copy (bytes read + written per second)."""
    size = (1 << 30) if device == "cuda" else (64 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), iterations, device)
    return 2 * size / ms / 1e6


def measure_paged(
    name: str, compressed: bool, batch: int, context: int, shape: Shape, grid: Grid, device: str
) -> Row:
    """Decode time of one format, over one stream or the merged CSA streams."""
    fmt = FORMATS[name]
    layout = stream_layout(grid, compressed, context)
    streams = [
        random_stream(fmt, shape, batch, length, stride, bias, device)
        for length, stride, bias in layout
    ]
    use_triton = device == "cuda"
    attention = cache_ops(backend_for(device)).attention
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device=device)
    scale = shape.head_dim**-0.5
    seq_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def step() -> torch.Tensor:
        return attention(q, None, seq_starts, streams, scale)

    ms = time_ms(step, grid.iterations, device)
    vectors = batch * sum(length for length, _, _ in layout)
    note = "torch"
    if use_triton:  # the torch path gathers fp32 copies: check only where they stay small
        checked = vectors <= CHECKED_VECTORS
        note = f"rel err {kernel_error(step(), streams, q, scale):.1e}" if checked else ""
    method = method_name(name, compressed, grid)
    return Row(method, batch, context, ms, kv_bytes(fmt, shape, vectors), note)


CHECKED_VECTORS = 32 * 32768


def kernel_error(
    out: torch.Tensor, streams: list[PagedStream], q: torch.Tensor, scale: float
) -> float:
    """||triton - torch|| / ||torch|| of the decode output on the GPU: the kernels' check on
    real hardware (the test suite runs them under the interpreter only)."""
    seq_starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    expected = cache_attention_torch(q, None, seq_starts, streams, scale)
    return float((out - expected).norm() / expected.norm())


INDEX_SCORES = "int4 bounds index scores"


def measure_index_scores(batch: int, context: int, shape: Shape, grid: Grid, device: str) -> Row:
    """Decode scoring of a key-bounds index (int4, maxima in K, minima in V) for `context`
    tokens: one vector a block."""
    fmt = index_format("int4")
    length = max(1, context // shape.block_size)
    index = random_stream(fmt, shape, batch, length, 1, 0.0, device)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, device=device)
    products = cache_ops(backend_for(device)).index_products
    ms = time_ms(lambda: products(q, index, length, "bounds"), grid.iterations, device)
    note = "torch"
    if device == "cuda":
        expected = index_products_torch(q, index, length, "bounds")
        got = products(q, index, length, "bounds")
        note = f"rel err {float((got - expected).norm() / expected.norm()):.1e}"
    return Row(INDEX_SCORES, batch, context, ms, kv_bytes(fmt, shape, batch * length), note)


def measure_sdpa(batch: int, context: int, shape: Shape, grid: Grid, device: str) -> Row:
    """Decode time of SDPA on a dense [batch, Hkv, context, D] cache (fp16 on GPU)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    k = torch.randn(batch, shape.num_kv_heads, context, shape.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    q = torch.randn(batch, shape.num_q_heads, 1, shape.head_dim, dtype=dtype, device=device)
    ms = time_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), grid.iterations, device
    )
    kv = 2 * k.numel() * k.element_size()
    return Row("SDPA dense", batch, context, ms, kv, "" if device == "cuda" else "fp32")


def guarded(measure: Callable[[], Row], row: Row, needed: int, device: str) -> Row:
    """Run a measurement unless it needs more device memory than is free; skip on OOM."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if needed > 0.9 * free:
            row.note = f"skipped: needs {needed / 2**30:.1f} GiB"
            return row
    try:
        return measure()
    except torch.OutOfMemoryError:
        row.note = "skipped: out of memory"
        return row
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def run_grid(shape: Shape, grid: Grid, device: str) -> list[Row]:
    """Every (batch, context): SDPA dense, then each format without and with compression."""
    rows = []
    for batch in grid.batches:
        for context in grid.contexts:
            dense_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * 2
            rows.append(
                guarded(
                    lambda b=batch, c=context: measure_sdpa(b, c, shape, grid, device),
                    Row("SDPA dense", batch, context),
                    dense_bytes,
                    device,
                )
            )
            for name, fmt in FORMATS.items():
                for compressed in (False, True):
                    layout = stream_layout(grid, compressed, context)
                    needed = allocated_bytes(fmt, shape, batch, layout)
                    method = method_name(name, compressed, grid)
                    rows.append(
                        guarded(
                            lambda n=name, z=compressed, b=batch, c=context: measure_paged(
                                n, z, b, c, shape, grid, device
                            ),
                            Row(method, batch, context),
                            needed,
                            device,
                        )
                    )
            index_bytes = kv_bytes(index_format("int4"), shape, batch * context)
            rows.append(
                guarded(
                    lambda b=batch, c=context: measure_index_scores(b, c, shape, grid, device),
                    Row(INDEX_SCORES, batch, context),
                    index_bytes,
                    device,
                )
            )
    return rows


def speedup(baseline: Row | None, row: Row) -> str:
    if baseline is None or math.isnan(baseline.ms) or math.isnan(row.ms):
        return "-"
    return f"{baseline.ms / row.ms:.2f}x"


def backend_for(device: str) -> str:
    """The kernels with tf32 dots on a GPU (fp32 `ieee` dots run on the CUDA cores there, 20-130x
    slower: RESULTS.md, "Kernels on an H200"); the torch path on a CPU."""
    return "triton_tf32" if device == "cuda" else "torch"


def render(rows: list[Row], copy_gbps: float, device: str) -> Table:
    """The results table: one line a configuration, speed-ups against the same batch/context."""
    title = (
        f"decode attention, {backend_for(device)} on {device} (device copy {copy_gbps:.1f} GB/s)"
    )
    table = Table(title=title)
    for column in (
        "method",
        "batch",
        "context",
        "median ms",
        "KV MB",
        "GB/s",
        "% copy",
        "vs fp16 paged",
        "vs SDPA dense",
        "note",
    ):
        justify = "left" if column in ("method", "note") else "right"
        table.add_column(column, justify=justify, no_wrap=True)
    by_key = {(row.method, row.batch, row.context): row for row in rows}
    for row in rows:
        key = (row.batch, row.context)
        gbps = row.kv_bytes / row.ms / 1e6 if not math.isnan(row.ms) else math.nan
        table.add_row(
            row.method,
            str(row.batch),
            str(row.context),
            f"{row.ms:.3f}",
            f"{row.kv_bytes / 1e6:.1f}",
            f"{gbps:.1f}",
            f"{100 * gbps / copy_gbps:.0f}%",
            speedup(by_key.get(("fp16 paged", *key)), row),
            speedup(by_key.get(("SDPA dense", *key)), row),
            row.note,
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--smoke", action="store_true", help="a small grid, seconds not minutes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    grid = GRIDS[("cpu" if args.device == "cpu" else "cuda") + ("-smoke" if args.smoke else "")]
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps(args.device, grid.iterations)
    rows = run_grid(Shape(), grid, args.device)
    # A pipe or log file gets a wide table rather than rich's 80-column default.
    Console(width=None if sys.stdout.isatty() else 160).print(render(rows, copy_gbps, args.device))


if __name__ == "__main__":
    main()
