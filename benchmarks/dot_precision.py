"""What tf32 dot products cost against ieee (fp32) ones: kernel error and time, engine logits.

The attention kernels take `dot_precision` ("ieee" or "tf32"; runtime backends `triton` and
`triton_tf32`). tf32 rounds q, k, p and v to 10 mantissa bits before each product on the
tensor cores; this measures whether that is negligible, three ways:

- `--emulate` (any machine, no kernels): that rounding applied around an fp32 attention over
  random vectors, the bound tests/kernels/attention/test_attention_precision.py derives its
tolerance from. - kernels: decode and prefill over paged fp16 / fp8 / fp4 caches, each precision's
  relative error against the fp32 torch reference on the same device and its median time (tf32 /
ieee). - engine (`--engine`): prompt logits of a random-weight tiny Llama (and of the embedded model
  when it is installed) under `triton` vs `triton_tf32`, beside `triton` vs `torch` (the
  floor of numerical noise) and each quantized policy vs fp16 (the effect being tuned).

    python -m benchmarks.dot_precision --emulate
    python -m benchmarks.dot_precision --device cuda --engine     # on the GPU
    TRITON_INTERPRET=1 python -m benchmarks.dot_precision --device cpu --smoke --engine
    TRITON_INTERPRET=1 python -m benchmarks.dot_precision --device cpu --engine   # ~10 min

Under the interpreter every dot is fp32, so on the CPU both precisions agree exactly: the
smoke run checks the plumbing, not tf32.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.kernels import FORMATS, Shape, random_stream, time_ms
from kvtune.kernels.attention.decode import decode_attention
from kvtune.kernels.attention.paged import paged_attention_ref, stream_attention
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy

PRECISIONS = ("ieee", "tf32")


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 (10 mantissa bits), round to nearest, ties away (PTX cvt.rna.tf32.f32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def emulated_attention(q, k, v, scale, rounding) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v with `rounding` applied to each product's inputs: out, lse."""
    logits = rounding(q) @ rounding(k).T * scale
    peak = logits.max(dim=-1, keepdim=True).values
    p = torch.exp(logits - peak)
    out = rounding(p) @ rounding(v) / p.sum(dim=-1, keepdim=True)
    return out, torch.logsumexp(logits, dim=-1)


def emulate(trials: int = 20) -> tuple[float, float]:
    """Worst (output relative error, LSE error / max(1, |lse|)) of tf32 rounding over random
    q [8, D], k, v [L, D] for D in 64/96/128 and L in 1..1000 (seeded)."""
    generator = torch.Generator().manual_seed(0)
    worst_out = worst_lse = 0.0
    for dim in (64, 96, 128):
        for length in (1, 8, 37, 150, 1000):
            for _ in range(trials):
                q, k, v = (torch.randn(n, dim, generator=generator) for n in (8, length, length))
                exact = emulated_attention(q, k, v, dim**-0.5, lambda x: x)
                tf32 = emulated_attention(q, k, v, dim**-0.5, round_to_tf32)
                out_error = ((tf32[0] - exact[0]).norm() / exact[0].norm()).item()
                lse_error = ((tf32[1] - exact[1]).abs() / exact[1].abs().clamp_min(1)).max()
                worst_out, worst_lse = max(worst_out, out_error), max(worst_lse, lse_error.item())
    return worst_out, worst_lse


@dataclass(frozen=True)
class Case:
    """One kernel configuration: decode (one query a sequence) or a prefill chunk."""

    phase: str
    fmt: str
    batch: int
    context: int
    chunk: int  # query tokens a sequence (1 = decode)


def kernel_cases(device: str, smoke: bool) -> list[Case]:
    if device == "cpu":
        contexts, batches, chunk = (64,), (2,), 16
    elif smoke:
        contexts, batches, chunk = (4096,), (8,), 256
    else:
        contexts, batches, chunk = (4096, 32768), (1, 8, 32), 512
    cases = []
    # Interpreted on a CPU: fp4 with group scales (the most work a tile) only.
    for fmt in ("fp4",) if device == "cpu" else FORMATS:
        for context in contexts:
            for batch in batches:
                cases.append(Case("decode", fmt, batch, context, 1))
            cases.append(Case("prefill", fmt, 1, context, chunk))
    return cases


def measure_kernel(case: Case, shape: Shape, iterations: int, device: str) -> list[list[str]]:
    """One row per precision: ms, time / ieee time, relative error vs the fp32 reference."""
    stream = random_stream(FORMATS[case.fmt], shape, case.batch, case.context, 1, 0.0, device)
    tokens = case.batch * case.chunk
    q = torch.randn(tokens, shape.num_q_heads, shape.head_dim, device=device)
    seq_starts = torch.arange(0, tokens + 1, case.chunk, dtype=torch.int32, device=device)
    positions = None
    if case.phase == "prefill":  # the chunk is the sequence's last `chunk` positions
        offsets = torch.arange(case.chunk, device=device) + case.context - case.chunk
        positions = offsets.repeat(case.batch).to(torch.int32)
    scale = shape.head_dim**-0.5
    reference = paged_attention_ref(q, positions, seq_starts, stream, scale)[0]
    # The default split count fills 132 multiprocessors; interpreted, each split costs time.
    splits = 2 if device == "cpu" else None
    rows, baseline = [], math.nan
    for precision in PRECISIONS:

        def run(precision=precision):
            if positions is None:
                return decode_attention(q, stream, scale, splits, dot_precision=precision)[0]
            return stream_attention(
                q, positions, seq_starts, stream, scale, case.chunk, dot_precision=precision
            )[0]

        error = ((run() - reference).norm() / reference.norm()).item()
        ms = time_ms(run, iterations, device)
        baseline = ms if precision == "ieee" else baseline
        rows.append(
            [
                case.phase,
                case.fmt,
                str(case.batch),
                str(case.context),
                precision,
                f"{ms:.3f}",
                f"{ms / baseline:.2f}x",
                f"{error:.1e}",
            ]
        )
    return rows


def kernel_table(device: str, smoke: bool) -> Table:
    table = Table(title=f"attention kernels by dot precision on {device}")
    for column in ("phase", "format", "batch", "context", "precision", "median ms"):
        table.add_column(column, justify="left" if column in ("phase", "format") else "right")
    table.add_column("vs ieee", justify="right")
    table.add_column("rel err vs fp32 ref", justify="right")
    iterations = 1 if device == "cpu" else 20
    # Under the interpreter a Llama-3-8B layer's 32 heads take seconds a launch: 4 heads.
    shape = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64) if device == "cpu" else Shape()
    for case in kernel_cases(device, smoke):
        try:
            for row in measure_kernel(case, shape, iterations, device):
                table.add_row(*row)
        except torch.OutOfMemoryError:
            table.add_row(case.phase, case.fmt, str(case.batch), str(case.context), "-", "OOM")
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    return table


ENGINE_POLICIES = {
    "fp16": KVPolicy("fp16", "fp16", block_size=16, chunk_size=128),
    "fp8": KVPolicy("fp8", "fp8", group_size="tensor", block_size=16, chunk_size=128),
    "fp4 g16 e4m3 + csa4": KVPolicy(
        "fp4", "fp4", group_size=16, scale_dtype="e4m3", csa_ratio=4, csa_window=64
    ),
}


def logits_gap(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Relative L2 error, largest |difference|, top-1 agreement and mean KL(expected||actual)."""
    log_p, log_q = expected.log_softmax(-1), actual.log_softmax(-1)
    return {
        "rel": ((actual - expected).norm() / expected.norm()).item(),
        "max": (actual - expected).abs().max().item(),
        "top1": (actual.argmax(-1) == expected.argmax(-1)).float().mean().item(),
        "kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
    }


def prompt_logits(model: str, policy: KVPolicy, backend: str, device: str, prompts) -> torch.Tensor:
    from kvtune.runtime import LLM

    longest = max(len(prompt) for prompt in prompts)
    llm = LLM(model, policy=policy, backend=backend, device=device, max_model_len=longest + 8)
    return torch.cat(llm.prompt_logits_batch(prompts))


def engine_rows(
    name: str, model: str, vocab: int, device: str, tokens: int, policies: list[str]
) -> list[list[str]]:
    """Per policy: tf32 vs ieee, ieee vs torch (the noise floor) and, after the first policy,
    the policy vs the first (the effect being tuned), all on prompt logits."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (tokens,), generator=generator).tolist() for _ in range(2)]
    rows, first = [], None
    for label in policies:
        policy = ENGINE_POLICIES[label]
        logits = {
            backend: prompt_logits(model, policy, backend, device, prompts)
            for backend in ("torch", "triton", "triton_tf32")
        }
        comparisons = [
            ("triton_tf32 vs triton", logits["triton_tf32"], logits["triton"]),
            ("triton vs torch", logits["triton"], logits["torch"]),
        ]
        if first is None:
            first = logits["triton"]
        else:
            comparisons.append((f"policy vs {policies[0]} (triton)", logits["triton"], first))
        for what, actual, expected in comparisons:
            gap = logits_gap(actual, expected)
            rows.append(
                [
                    name,
                    label,
                    what,
                    f"{gap['rel']:.1e}",
                    f"{gap['max']:.1e}",
                    f"{gap['top1']:.4f}",
                    f"{gap['kl']:.1e}",
                ]
            )
    return rows


def engine_table(device: str, smoke: bool) -> Table:
    from kvtune.runtime.model_source import resolve_model
    from tests.runtime.conftest import TINY_VOCAB, build_tiny_model

    table = Table(title=f"engine prompt logits by backend on {device}")
    for column in ("model", "policy", "comparison", "rel L2", "max |diff|", "top-1", "KL"):
        table.add_column(column, justify="left" if column in ("model", "comparison") else "right")
    tokens = 48 if smoke or device == "cpu" else 512
    # A smoke run takes only the policy that uses every kernel.
    policies = [*ENGINE_POLICIES][-1:] if smoke else [*ENGINE_POLICIES]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp), "llama")
        rows = engine_rows("tiny llama (random)", str(tiny), TINY_VOCAB, device, tokens, policies)
        for row in rows:
            table.add_row(*row)
    if smoke:
        table.add_row("smollm2-135m", "-", "skipped in a smoke run")
        return table
    try:
        resolve_model("smollm2-135m")
    except (ConfigError, ImportError) as missing:
        table.add_row("smollm2-135m", "-", f"skipped: {missing}")
        return table
    for row in engine_rows("smollm2-135m", "smollm2-135m", 49152, device, tokens, policies):
        table.add_row(*row)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--smoke", action="store_true", help="one context, one batch")
    parser.add_argument("--emulate", action="store_true", help="the tf32 rounding bound only")
    parser.add_argument("--engine", action="store_true", help="also the engine's prompt logits")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    worst_out, worst_lse = emulate(3 if args.smoke else 20)
    console.print(
        f"tf32 rounding emulated around fp32 attention (D 64-128, 1-1000 keys): worst output "
        f"relative error {worst_out:.2e}, worst LSE error {worst_lse:.2e}"
    )
    if args.emulate:
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.device == "cuda":  # fp32 references: no TF32 in torch's own matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    console.print(kernel_table(args.device, args.smoke))
    if args.engine:
        console.print(engine_table(args.device, args.smoke))
    if args.device == "cuda":
        console.print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
