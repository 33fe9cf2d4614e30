"""Does the cheap suite rank policies as a larger held-out one does, above all where the tuner
decides (held-out retention >= 0.9, constraints.min_retention)?

For 25 policies across the space (the first 14 meant for the decision region: fp8 at group
sizes and per tensor, K fp8 / V fp4 at g16/g32/g64, recent windows, per-layer mixes; then
int8, int4 with and without a Hadamard rotation and per-channel keys, fp4, CSA and per-tensor
fp4), each policy's
accuracy retention on the default `quick` suite is compared with its mean retention over
held-out seeds of the `heldout` preset (other documents and needles, 1.5x the context, more
haystacks; `--heldout-seeds 1,2`). Reported:
retentions with their bootstrap standard errors (per seed too), greedy exact-match retention
and KL on each, and Spearman rank correlations overall (target >= 0.95) and inside the
decision region (target >= 0.8), for the headline and for the gold-answer probability it
replaced, and between the two held-out seeds (how far two independent draws agree). Each
(policy, suite) result is cached under
<kvtune cache>/eval-validity, keyed by content (model files, suite and its task rows, policy,
evaluation code), so an interrupted run resumes where it stopped and a change of code, weights
or suite never serves a stale row.

    .venv/bin/python -m benchmarks.eval_validity [--cheap quick] [--heldout heldout]
        [--heldout-seeds 1,2] [--policies "fp16,fp8 g32,..."] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvtune.autotune.cache import ACCURACY_CODE, JsonCache, code_key, default_cache_folder
from kvtune.autotune.evaluation import EvalSuite, evaluate, load_suite
from kvtune.autotune.evaluation.baseline_cache import suite_content_fingerprint
from kvtune.autotune.evaluation.evaluator import eval_cache_dir
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy

LAYERS = 30  # SmolLM2-135M
# Per-layer mixes: the first and last four layers keep the better format (K is the sensitive
# stream, and the outer layers the sensitive layers of the sensitivity profile).
OUTER = (*range(4), *range(LAYERS - 4, LAYERS))


def _mixed(outer: str, inner: str) -> tuple[str, ...]:
    return tuple(outer if layer in OUTER else inner for layer in range(LAYERS))


# The decision region (retention above ~0.9) first: fp8 variants, K fp8 / V fp4 at several
# group sizes, recent windows, per-layer mixes; then the rest of the space.
POLICIES: dict[str, KVPolicy] = {
    "fp16": KVPolicy("fp16", "fp16"),
    "bf16": KVPolicy("bf16", "bf16"),
    "fp8 g16": KVPolicy("fp8", "fp8", group_size=16),
    "fp8 g32": KVPolicy("fp8", "fp8", group_size=32),
    "fp8 g64": KVPolicy("fp8", "fp8", group_size=64),
    "fp8 tensor": KVPolicy("fp8", "fp8", group_size="tensor"),
    "fp8 g32 + recent 128": KVPolicy("fp8", "fp8", group_size=32, recent_unquantized=128),
    "K fp16 / V fp8": KVPolicy("fp16", "fp8", group_size=32),
    "K fp8 / V fp4 g16": KVPolicy("fp8", "fp4", group_size=16, scale_dtype="e4m3"),
    "K fp8 / V fp4 g32": KVPolicy("fp8", "fp4", group_size=32),
    "K fp8 / V fp4 g32 + recent 128": KVPolicy("fp8", "fp4", group_size=32, recent_unquantized=128),
    "fp8 outer + K fp8 / V fp4 inner": KVPolicy(
        "fp8", "fp4", layer_dtypes=_mixed("fp8/fp8", "fp8/fp4"), group_size=32
    ),
    "fp16 outer + fp8 inner": KVPolicy(
        "fp8", "fp8", layer_dtypes=_mixed("fp16/fp16", "fp8/fp8"), group_size=32
    ),
    "fp8 outer + fp4 g16 inner": KVPolicy(
        "fp8", "fp8", layer_dtypes=_mixed("fp8/fp8", "fp4/fp4"), group_size=16
    ),
    "int8 g32": KVPolicy("int8", "int8", group_size=32),
    "K int8 / V int4 g32": KVPolicy("int8", "int4", group_size=32),
    "int4 g32 + hadamard": KVPolicy("int4", "int4", group_size=32, rotation="hadamard"),
    "int4 g32": KVPolicy("int4", "int4", group_size=32),
    "int4 K channel b16 / V g32 + hadamard": KVPolicy(
        "int4", "int4", group_size=32, rotation="hadamard", k_scale_axis="channel"
    ),
    "int4 K channel b32 / V g64 + hadamard": KVPolicy(
        "int4", "int4", group_size=64, rotation="hadamard", k_scale_axis="channel", block_size=32
    ),
    "fp8 + csa4": KVPolicy("fp8", "fp8", group_size="tensor", csa_ratio=4, csa_window=256),
    "fp4 g16 e4m3": KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"),
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
    the evaluation code (kvtune/autotune/cache.py)."""
    return {
        "model": model_fingerprint(resolve_model(suite.model)),
        "suite": suite_content_fingerprint(suite, eval_cache_dir()),
        "policy": policy.to_dict(),
        "code": code_key(*ACCURACY_CODE),
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


# Where the tuner decides: constraints.min_retention is about 0.9.
DECISION_RETENTION = 0.9


def with_seed(suite: EvalSuite, seed: int) -> EvalSuite:
    """The suite over other documents and needles (same sizes and runtime)."""
    return EvalSuite.from_dict({**suite.to_dict(), "seed": seed, "name": f"{suite.name} s{seed}"})


def mean_result(results: list[dict]) -> dict:
    """Held-out figures averaged over seeds; stderr of the mean of independent estimates."""
    keys = ("accuracy_retention", "score_retention", "kl", "exact_match_retention")
    merged = {key: float(np.mean([r[key] for r in results])) for key in keys}
    errors = [r["accuracy_retention_stderr"] or 0.0 for r in results]
    merged["accuracy_retention_stderr"] = float(np.sqrt(np.sum(np.square(errors)))) / len(errors)
    per_task = ("retention", "exact_match", "baseline_exact_match")
    merged["tasks"] = {
        task: {
            key: float(np.mean([r["tasks"][task][key] for r in results]))
            for key in per_task
            if key in row
        }
        for task, row in results[0]["tasks"].items()
    }
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cheap", default="quick", help="the suite a trial pays for")
    parser.add_argument("--heldout", default="heldout", help="preset name or YAML path")
    parser.add_argument(
        "--heldout-seeds", default="1,2", help="held-out seeds (other documents), comma-separated"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    names = [name.strip() for name in args.policies.split(",")]
    cheap = load_suite(args.cheap)
    heldouts = [with_seed(load_suite(args.heldout), int(s)) for s in args.heldout_seeds.split(",")]
    console = Console()
    cache = JsonCache(default_cache_folder("eval-validity"))
    rows = []
    for name in names:
        started = time.perf_counter()
        a = cached_evaluate(POLICIES[name], cheap, cache)
        seeds = [cached_evaluate(POLICIES[name], suite, cache) for suite in heldouts]
        rows.append((name, a, mean_result(seeds), seeds))
        held = ", ".join(fmt(r["accuracy_retention"]) for r in seeds)
        console.log(
            f"{name}: {cheap.name} {fmt(a['accuracy_retention'])}, held out {held} "
            f"({time.perf_counter() - started:.0f} s)"
        )
    print_table(args.markdown, cheap, heldouts, rows, console)


def correlations(rows: list, cheap_name: str) -> str:
    """Spearman of the cheap suite against the held-out mean, overall and in the decision
    region, and between held-out seeds (the agreement two independent draws reach)."""

    def rho(selected: list, cheap_key: str, heldout_key: str = "accuracy_retention") -> str:
        if len(selected) < 3:
            return "-"
        sign = -1.0 if cheap_key == "kl" else 1.0  # a lower KL ranks higher
        a = [sign * row[1][cheap_key] for row in selected]
        return f"{spearman(a, [row[2][heldout_key] for row in selected]):.3f}"

    region = [row for row in rows if row[2]["accuracy_retention"] >= DECISION_RETENTION]
    parts = [
        f"Spearman, {cheap_name} vs held-out accuracy retention: {rho(rows, 'accuracy_retention')} "
        f"over {len(rows)} policies (target >= 0.95), {rho(region, 'accuracy_retention')} over "
        f"the {len(region)} with held-out retention >= {DECISION_RETENTION} (target >= 0.8)",
        f"score retention (gold-answer probability, the headline before 2026-12-02): "
        f"{rho(rows, 'score_retention', 'score_retention')} "
        f"(region {rho(region, 'score_retention', 'score_retention')})",
        f"exact-match retention: {rho(rows, 'exact_match_retention', 'exact_match_retention')}",
        f"-{cheap_name} KL vs held-out retention: {rho(rows, 'kl')} (region {rho(region, 'kl')})",
    ]
    if rows and len(rows[0][3]) >= 2:

        def between(selected: list) -> str:
            if len(selected) < 3:
                return "-"
            first = [row[3][0]["accuracy_retention"] for row in selected]
            second = [row[3][1]["accuracy_retention"] for row in selected]
            return f"{spearman(first, second):.3f}"

        parts.append(f"held-out seed vs seed: {between(rows)} (region {between(region)})")
    return "; ".join(parts) + "."


def print_table(
    markdown: bool, cheap: EvalSuite, heldouts: list[EvalSuite], rows: list, console: Console
) -> None:
    seeds = "/".join(str(suite.seed) for suite in heldouts)
    header = [
        "policy",
        f"{cheap.name} retention",
        "± stderr",
        f"held-out retention (seeds {seeds})",
        "± stderr",
        "per seed",
        f"{cheap.name} KL",
        "held-out KL",
        f"{cheap.name} exact-match ret.",
        "held-out exact-match ret.",
        f"{cheap.name} s",
    ]
    body = [
        [
            name,
            fmt(a["accuracy_retention"]),
            fmt(a["accuracy_retention_stderr"]),
            fmt(b["accuracy_retention"]),
            fmt(b["accuracy_retention_stderr"]),
            " / ".join(fmt(r["accuracy_retention"]) for r in per_seed),
            fmt(a["kl"], 4),
            fmt(b["kl"], 4),
            fmt(a["exact_match_retention"]),
            fmt(b["exact_match_retention"]),
            f"{a['seconds']:.0f}",
        ]
        for name, a, b, per_seed in rows
    ]
    summary = (
        f"{correlations(rows, cheap.name)} torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f}."
    )
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in body:
            print("| " + " | ".join(line) + " |")
        print(f"\n{summary}")
        return
    table = Table(title=f"Validity of the {cheap.name} suite against {heldouts[0].name}")
    for column in header:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for line in body:
        table.add_row(*line)
    console.print(table)
    console.print(summary)


if __name__ == "__main__":
    main()
