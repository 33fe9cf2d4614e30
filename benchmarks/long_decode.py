"""Decode cost at long context (issue 39 item 4): a selecting policy's decode step against
fp16's in the same run, with the bytes it moves from the host tier each step.

For each --contexts length, one fp16 engine and one engine a policy (the same loaded weights)
each take one sequence of random prompt ids to decode; then --runs paired runs, each
--steps decode steps of both engines in turns (benchmarks.decoding.paired_medians), give one
ratio each: the policy's median step over fp16's. fp16 runs the decode path the runtime uses by
default (on a CPU, the fused native decode kernel). Per step: the host-tier bytes fetched into
staging (kv_fetched_bytes) and the host-tier key bytes read to rescore a two-stage shortlist
(kv_rescored_bytes), with fp16's whole cache bytes at that length for scale. Timings are not
cached: rerun on an idle machine.

    .venv/bin/python -m benchmarks.long_decode [--model qwen2.5-coder-0.5b]
        [--contexts 8192,16384] [--policies "<benchmarks.compression names, comma-separated>"]
        [--runs 6] [--steps 8] [--backend torch] [--device cpu] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console

from benchmarks.compression import POLICIES
from benchmarks.decoding import finish_running, paired_medians, random_prompts, start_decoding
from benchmarks.formats import FP16, bytes_ratio
from benchmarks.tables import print_rows
from kvtune.runtime import LLM
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.backends import BACKENDS
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.model_source import resolve_model

DEFAULT_POLICIES = (
    "int4 K channel / V rotated w256 + top80 host no summaries int4 index",
    "int4 K channel / V rotated w256 + top80 streamed no summaries int4 index rescored x4",
)
# Decode steps a sequence may take beyond the timed ones (the first token included).
HEADROOM = 64


def timed_runs(
    base: LLM, llm: LLM, context: int, runs: int, steps: int
) -> tuple[list[tuple[float, float]], float, float]:
    """([(fp16 median step, policy median step)] a run, host bytes fetched a step, host key
    bytes rescored a step) of one `context`-token sequence decoding in each engine."""
    prompts = random_prompts(context, 1)
    engines = [base.engine, llm.engine]
    for engine in engines:
        start_decoding(engine, prompts, runs * steps + HEADROOM)
    before = llm.engine.stats()
    pairs = [tuple(paired_medians(engines, steps)) for _ in range(runs)]
    after = llm.engine.stats()
    for engine in engines:
        finish_running(engine)
    taken = runs * steps
    fetched = (after["kv_fetched_bytes"] - before["kv_fetched_bytes"]) / taken
    rescored = (after["kv_rescored_bytes"] - before["kv_rescored_bytes"]) / taken
    return pairs, fetched, rescored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--contexts", default="8192,16384")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default="torch", choices=sorted(BACKENDS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    if args.runs < 1 or args.steps < 1:
        parser.error(f"--runs {args.runs}, --steps {args.steps}: allowed: positive counts")
    contexts = [int(c) for c in args.contexts.split(",")]
    folder = resolve_model(args.model)
    arch = arch_from_folder(folder)
    arch.check_context(max(contexts) + args.runs * args.steps + HEADROOM, "--contexts")
    console = Console()
    lines = []
    for context in contexts:
        base = LLM(
            folder,
            policy=FP16,
            backend=args.backend,
            device=args.device,
            max_model_len=context + args.runs * args.steps + HEADROOM,
            max_num_seqs=1,
        )
        fp16_bytes = kv_bytes_per_sequence(arch, FP16, context)
        for name in names:
            policy = POLICIES[name]
            pairs, fetched, rescored = timed_runs(
                base, base.with_policy(policy), context, args.runs, args.steps
            )
            ratios = [step / fp16_step for fp16_step, step in pairs]
            lines.append(
                [
                    str(context),
                    name,
                    f"{bytes_ratio(arch, policy, context):.3f}",
                    f"{fetched / fp16_bytes:.4f}",
                    f"{rescored / fp16_bytes:.4f}",
                    f"{statistics.median(p[0] for p in pairs) * 1e3:.0f}",
                    " ".join(f"{r:.2f}" for r in ratios),
                    f"{statistics.fmean(ratios):.2f}",
                    f"{max(ratios):.2f}",
                ]
            )
            print(" | ".join(lines[-1]), flush=True)
    headers = [
        "context",
        "policy",
        "device bytes / fp16",
        "fetched a step / fp16 cache",
        "rescored a step / fp16 cache",
        "fp16 step ms",
        "step / fp16's, each run",
        "mean",
        "max",
    ]
    print_rows(headers, lines, args.markdown, console)


if __name__ == "__main__":
    main()
