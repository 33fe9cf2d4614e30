"""Every quantized format's decode step against kvtune's own fp16 step, in one run (issue 41's
second CPU target: each format <= 1.0x the fused fp16 step at batches 1, 4 and 8 and contexts
2K and 8K, no run above 1.1).

For each --contexts x --batches shape and format, one fp16 engine and one engine the format
(loaded once each) take the same random prompts of the context's length (cut to leave room for
the timed steps within the model's positions) and decode; --runs paired runs of
--steps decode steps of both engines in turns (`benchmarks.decoding.paired_medians`) give one
ratio each, the format's median step over fp16's. Both run the runtime's default decode path
(on a CPU: the fused native kernel for every format it serves, the torch path for the others,
named in the table). Formats: every quantized element format of the registry at its default
layout (`KVPolicy(dtype, dtype)`: groups of 32 with fp16 scales, whole vectors or the
format's own scale dtype where it needs them) and the formats table's equal-bytes policy.

Each row is cached under kvtune's cache, keyed by the model's files, its policy, shape, runs
and steps, the runtime's and kernels' code and the machine, so that an interrupted run
resumes where it stopped; --fresh measures every row again.

    .venv/bin/python -m benchmarks.format_steps [--formats fp8,int4,...] [--batches 1,4,8]
        [--contexts 2048,8192] [--runs 6] [--steps 4] [--fresh] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from rich.console import Console

from benchmarks.decoding import finish_running, paired_medians, random_prompts, start_decoding
from benchmarks.formats import POLICIES
from benchmarks.llamacpp_peer import EQUAL_BYTES_POLICY
from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, code_key, default_cache_folder, machine_fingerprint
from kvtune.kernels.cache.pool import KVPool
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.native.build import load_kernel
from kvtune.kernels.native.decode_attention import SOURCE
from kvtune.kernels.native.pool_codes import pool_codes
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.arch import ModelArch, arch_from_folder
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model_source import resolve_model

MODEL = "smollm2-135m"
BATCHED_TOKENS = 2048  # the engine's prefill chunk
# Decode steps a sequence may take beyond the timed ones (its first token, discarded steps).
HEADROOM = 16
MEASURING_CODE = ("kvtune.runtime", "kvtune.kernels", "benchmarks.format_steps")


def registry_policy(dtype: str, head_dim: int) -> KVPolicy:
    """A format's default layout: groups of 32 with fp16 scales, except whole vectors for a
    format that codes them and the scale dtype a format's scales must take."""
    element = ELEMENT_FORMATS[dtype]
    fields: dict[str, Any] = {}
    if element.whole_vector:
        fields["group_size"] = head_dim
    if element.scale_dtype:
        fields["scale_dtype"] = element.scale_dtype
    return KVPolicy(dtype, dtype, **fields)


def format_policies(names: list[str] | None, head_dim: int) -> dict[str, KVPolicy]:
    """The named formats (registry dtypes or the formats table's policy names), else every
    quantized registry format and the equal-bytes policy."""
    if names is None:
        names = [n for n, e in ELEMENT_FORMATS.items() if e.quantized] + [EQUAL_BYTES_POLICY]
    return {
        name: POLICIES[name] if name in POLICIES else registry_policy(name, head_dim)
        for name in names
    }


def decode_path(arch: ModelArch, policy: KVPolicy) -> str:
    """ "fused" where the native decode kernel is built and reads every layer's K and V format,
    else "torch" (its torch path runs for those layers)."""
    if load_kernel(SOURCE) is None:
        return "torch"
    for formats in layer_formats(arch, policy):
        for fmt in (formats.k, formats.v):
            scale = torch.tensor([1.0]) if fmt.quantized else None
            pool = KVPool.allocate(
                fmt, 1, policy.block_size, arch.num_kv_heads, arch.head_dim, scale
            )
            if pool_codes(pool) is None:
                return "torch"
    return "fused"


def timed_pairs(
    base: LLM, llm: LLM, prompts: list[list[int]], runs: int, steps: int
) -> list[tuple[float, float]]:
    """(fp16 median step, format median step) seconds of each run, both engines decoding the
    same prompts from their own prefill."""
    engines = [base.engine, llm.engine]
    for engine in engines:
        start_decoding(engine, prompts, runs * steps + HEADROOM)
    try:
        return [tuple(paired_medians(engines, steps)) for _ in range(runs)]
    finally:
        for engine in engines:
            finish_running(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", help="comma-separated; default: every quantized format")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="decode steps a side per run")
    parser.add_argument("--fresh", action="store_true", help="measure cached rows again")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    folder = resolve_model(MODEL)
    arch, weights = arch_from_folder(folder), model_fingerprint(folder)
    policies = format_policies(args.formats.split(",") if args.formats else None, arch.head_dim)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    cache = JsonCache(default_cache_folder("format_steps"))
    console = Console(stderr=True)
    engine_args = dict(
        max_model_len=arch.max_position_embeddings,
        max_num_seqs=max(batches),
        max_num_batched_tokens=BATCHED_TOKENS,
    )
    base = LLM(MODEL, policy=KVPolicy("fp16", "fp16"), **engine_args)
    lines = []
    for context in contexts:
        prompt_len = min(context, arch.max_position_embeddings - args.runs * args.steps - HEADROOM)
        for batch in batches:
            prompts = random_prompts(prompt_len, batch)
            for name, policy in policies.items():
                key = {
                    "benchmark": "format_steps",
                    "model": weights,
                    "policy": policy.to_dict(),
                    "batch": batch,
                    "prompt_len": prompt_len,
                    "runs": args.runs,
                    "steps": args.steps,
                    "code": code_key(*MEASURING_CODE),
                    "machine": machine_fingerprint("cpu"),
                }
                row = None if args.fresh else cache.get(key)
                if row is None:
                    llm = LLM(MODEL, policy=policy, **engine_args)
                    pairs = timed_pairs(base, llm, prompts, args.runs, args.steps)
                    del llm
                    row = {"pairs": pairs, "path": decode_path(arch, policy)}
                    cache.put(key, row)
                ratios = [mine / fp16 for fp16, mine in row["pairs"]]
                line = [
                    name,
                    row["path"],
                    str(batch),
                    str(context),
                    f"{1000 * statistics.mean(fp16 for fp16, _ in row['pairs']):.1f}",
                    f"{statistics.mean(ratios):.2f}",
                    f"{max(ratios):.2f}",
                    " ".join(f"{r:.2f}" for r in ratios),
                ]
                console.log(" | ".join(line))
                lines.append(line)
    headers = ["format", "decode", "batch", "context", "fp16 ms/step", "ratio, mean"]
    headers += ["ratio, largest", "every run"]
    print_rows(headers, lines, args.markdown, Console())


if __name__ == "__main__":
    main()
