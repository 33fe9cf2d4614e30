"""Does the cheap suite rank policies as a larger held-out one does?

For policies across the space (formats, group sizes, scales, mixed K/V, recent window, CSA),
each policy's accuracy retention on the default `quick` suite is compared with its retention
on a held-out configuration (default: the `heldout` preset, another seed, 1.5x the context
and about 2.5x the samples; `--heldout full` for the larger one, hours on CPU). Reported:
both retentions with their paired-bootstrap standard errors, greedy exact-match retention and
KL divergence on each, and Spearman rank correlations between the suites (target >= 0.9 for
accuracy retention). Each (policy, suite) result is cached under
<kvtune cache>/eval-validity, keyed by content (model files, suite and its task rows, policy,
evaluation code), so an interrupted run resumes where it stopped and a change of code, weights
or suite never serves a stale row.

    .venv/bin/python -m benchmarks.eval_validity [--cheap quick] [--heldout heldout]
        [--policies "fp16,fp8,..."] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from autotune.cache import (
    ACCURACY_CODE,
    JsonCache,
    code_fingerprint,
    default_cache_folder,
    model_fingerprint,
)
from autotune.evaluation import EvalSuite, evaluate, load_suite
from autotune.evaluation.baseline_cache import suite_content_fingerprint
from autotune.evaluation.evaluator import eval_cache_dir
from runtime.model_source import resolve_model
from runtime.policy import KVPolicy

POLICIES: dict[str, KVPolicy] = {
    "fp16": KVPolicy("fp16", "fp16"),
    "fp8 g32": KVPolicy("fp8", "fp8", group_size=32),
    "fp8 tensor": KVPolicy("fp8", "fp8", group_size="tensor"),
    "fp8 + csa4": KVPolicy("fp8", "fp8", group_size="tensor", csa_ratio=4, csa_window=256),
    "K fp8 / V fp4 g16": KVPolicy("fp8", "fp4", group_size=16, scale_dtype="e4m3"),
    "fp4 g16 e4m3": KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"),
    "fp4 g16 + recent 256": KVPolicy(
        "fp4", "fp4", group_size=16, scale_dtype="e4m3", recent_unquantized=256
    ),
    "fp4 g32": KVPolicy("fp4", "fp4", group_size=32),
    "K fp4 g16 / V fp8": KVPolicy("fp4", "fp8", group_size=16, scale_dtype="e4m3"),
    "fp4 g64": KVPolicy("fp4", "fp4", group_size=64),
    "fp16 + csa8 w128": KVPolicy("fp16", "fp16", csa_ratio=8, csa_window=128, csa_sinks=16),
    "fp4 g16 + csa4": KVPolicy(
        "fp4", "fp4", group_size=16, scale_dtype="e4m3", csa_ratio=4, csa_window=256
    ),
    "fp4 tensor": KVPolicy("fp4", "fp4", group_size="tensor"),
}


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their average rank."""
    order = values.argsort(kind="stable")
    result = np.empty(len(values))
    result[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        result[tied] = result[tied].mean()
    return result


def spearman(a: list[float], b: list[float]) -> float:
    return float(np.corrcoef(ranks(np.asarray(a)), ranks(np.asarray(b)))[0, 1])


def validity_key(policy: KVPolicy, suite: EvalSuite) -> dict:
    """Content only: the model's files, the suite's definition and task rows, the policy and
    the evaluation code (autotune/cache.py)."""
    return {
        "model": model_fingerprint(resolve_model(suite.model)),
        "suite": suite_content_fingerprint(suite, eval_cache_dir()),
        "policy": policy.to_dict(),
        "code": code_fingerprint(*ACCURACY_CODE),
    }


def cached_evaluate(policy: KVPolicy, suite: EvalSuite, cache: JsonCache) -> dict:
    """evaluate(), read from the cache when this policy already ran on this suite and code."""
    key = validity_key(policy, suite)
    result = cache.get(key)
    if result is None:
        result = evaluate(policy, suite)
        cache.put(key, result)
    return result


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cheap", default="quick", help="the suite a trial pays for")
    parser.add_argument("--heldout", default="heldout", help="preset name or YAML path")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    names = [name.strip() for name in args.policies.split(",")]
    cheap, heldout = load_suite(args.cheap), load_suite(args.heldout)
    console = Console()
    cache = JsonCache(default_cache_folder("eval-validity"))
    rows = []
    for name in names:
        started = time.perf_counter()
        a = cached_evaluate(POLICIES[name], cheap, cache)
        b = cached_evaluate(POLICIES[name], heldout, cache)
        rows.append((name, a, b))
        console.log(
            f"{name}: {cheap.name} {fmt(a['accuracy_retention'])}, "
            f"{heldout.name} {fmt(b['accuracy_retention'])} ({time.perf_counter() - started:.0f} s)"
        )

    def correlation(cheap_key: str, heldout_key: str = "accuracy_retention") -> float:
        sign = -1.0 if cheap_key == "kl" else 1.0  # a lower KL ranks higher
        return spearman(
            [sign * a[cheap_key] for _, a, _ in rows], [b[heldout_key] for _, _, b in rows]
        )

    header = [
        "policy",
        f"{cheap.name} retention",
        "± stderr",
        f"{heldout.name} retention",
        "± stderr",
        f"{cheap.name} KL",
        f"{heldout.name} KL",
        f"{cheap.name} exact-match ret.",
        f"{heldout.name} exact-match ret.",
        f"{cheap.name} s",
    ]
    body = [
        [
            name,
            fmt(a["accuracy_retention"]),
            fmt(a["accuracy_retention_stderr"]),
            fmt(b["accuracy_retention"]),
            fmt(b["accuracy_retention_stderr"]),
            fmt(a["kl"], 4),
            fmt(b["kl"], 4),
            fmt(a["exact_match_retention"]),
            fmt(b["exact_match_retention"]),
            f"{a['seconds']:.0f}",
        ]
        for name, a, b in rows
    ]
    summary = (
        f"Spearman over {len(rows)} policies, {cheap.name} vs {heldout.name} accuracy retention: "
        f"{correlation('accuracy_retention'):.3f} (target >= 0.9); exact-match retention vs "
        f"exact-match retention: "
        f"{correlation('exact_match_retention', 'exact_match_retention'):.3f}; "
        f"-{cheap.name} KL vs {heldout.name} accuracy retention: {correlation('kl'):.3f}. "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}."
    )
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in body:
            print("| " + " | ".join(line) + " |")
        print(f"\n{summary}")
        return
    table = Table(title=f"Validity of the {cheap.name} suite against {heldout.name}")
    for column in header:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for line in body:
        table.add_row(*line)
    console.print(table)
    console.print(summary)


if __name__ == "__main__":
    main()
