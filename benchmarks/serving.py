"""Serving under load at a fixed KV budget: how quantization and compression change capacity
and tail latency.

A seeded Poisson trace (prompt and output lengths from lognormals) is replayed in real time
against the engine for each policy, all at the same KV byte budget. Reported: sequences the
budget holds at the trace's longest request (planner arithmetic), peak concurrent sequences
(measured), preemptions, output throughput, and P50/P99 end-to-end latency and TTFT.

    .venv/bin/python -m benchmarks.serving [--requests 24] [--rate 2.0] [--device cuda]

The engine runs the `torch` backend on the CPU and the Triton kernels (`triton`) on CUDA,
unless --backend says otherwise.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.model_source import resolve_model

MODEL = "smollm2-135m"

POLICIES = {
    "fp16": KVPolicy("fp16", "fp16"),
    "fp8": KVPolicy("fp8", "fp8", group_size="tensor"),
    "fp4 g16": KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"),
    "fp4 g16 + csa4": KVPolicy(
        "fp4", "fp4", group_size=16, scale_dtype="e4m3", csa_ratio=4, csa_window=256
    ),
}


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: list[int]
    output_tokens: int


def poisson_trace(
    requests: int, rate: float, prompt_median: int, output_median: int, vocab: int, seed: int
) -> list[Request]:
    """Exponential inter-arrival gaps (mean 1/rate s); lognormal lengths (sigma 0.6)."""
    rng = random.Random(seed)
    clock, trace = 0.0, []
    for _ in range(requests):
        clock += rng.expovariate(rate)
        prompt_len = max(8, int(rng.lognormvariate(math.log(prompt_median), 0.6)))
        output_len = max(2, int(rng.lognormvariate(math.log(output_median), 0.6)))
        prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        trace.append(Request(clock, prompt, output_len))
    return trace


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def replay(llm: LLM, trace: list[Request]) -> dict[str, float]:
    """Add requests at their arrival times, step the engine while work is queued."""
    engine = llm.engine
    pending, seqs, peak_running = list(trace), [], 0
    started = time.perf_counter()
    while pending or engine.scheduler.has_work:
        now = time.perf_counter() - started
        while pending and pending[0].arrival_s <= now:
            request = pending.pop(0)
            seqs.append(engine.add_request(request.prompt, request.output_tokens))
        if engine.scheduler.has_work:
            engine.step()
            peak_running = max(peak_running, len(engine.scheduler.running))
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - now))
    elapsed = time.perf_counter() - started
    latency = [s.metrics.e2e_latency for s in seqs]
    ttft = [s.metrics.ttft for s in seqs]
    return {
        "throughput": sum(len(s.output_ids) for s in seqs) / elapsed,
        "p50": percentile(latency, 50),
        "p99": percentile(latency, 99),
        "ttft_p99": percentile(ttft, 99),
        "peak_running": peak_running,
        "preemptions": engine.stats()["preemptions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", help="torch | triton | triton_tf32 (default: by device)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--prompt-median", type=int, default=256)
    parser.add_argument("--output-median", type=int, default=24)
    parser.add_argument(
        "--budget-sequences",
        type=float,
        default=3.0,
        help="KV budget as fp16 sequences of the longest request",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES), metavar="NAME"
    )
    args = parser.parse_args()
    backend = args.backend or ("triton" if args.device.startswith("cuda") else "torch")

    trace = poisson_trace(
        args.requests, args.rate, args.prompt_median, args.output_median, 49152, args.seed
    )
    longest = max(len(r.prompt) + r.output_tokens for r in trace)
    max_model_len = longest + 16
    table = Table(
        title=(
            f"Serving {args.requests} requests at {args.rate}/s (seed {args.seed}), {MODEL}, "
            f"{args.device} ({backend}), budget = {args.budget_sequences} fp16 sequences of "
            f"{longest} tokens"
        )
    )
    for column in (
        "policy",
        "KV MiB/seq",
        "seqs that fit",
        "peak running",
        "preemptions",
        "out tok/s",
        "P50 s",
        "P99 s",
        "TTFT P99 s",
    ):
        table.add_column(column, justify="right")
    arch = arch_from_folder(resolve_model(MODEL))
    budget = int(args.budget_sequences * kv_bytes_per_sequence(arch, POLICIES["fp16"], longest))
    for name in args.policies:
        policy = POLICIES[name]
        llm = LLM(
            MODEL,
            policy=policy,
            backend=backend,
            device=args.device,
            max_model_len=max_model_len,
            max_num_seqs=32,
            kv_budget_bytes=budget,
        )
        per_sequence = kv_bytes_per_sequence(arch, policy, longest)
        result = replay(llm, trace)
        table.add_row(
            name,
            f"{per_sequence / 2**20:.1f}",
            str(budget // per_sequence),
            str(result["peak_running"]),
            str(result["preemptions"]),
            f"{result['throughput']:.1f}",
            f"{result['p50']:.2f}",
            f"{result['p99']:.2f}",
            f"{result['ttft_p99']:.2f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
