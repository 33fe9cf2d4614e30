"""What the accuracy suite costs a tuning trial, and what the uncompressed baseline scores.

Runs the suite (default `quick`) for a few policies with the baseline cached, as a trial does,
and reports wall seconds per policy (target <= 60 s on 2 CPU cores) with the headline
retention, the score retention beside it and their standard errors, then the baseline's score
per task with its bootstrap standard error, its greedy exact match and the chance level.
Timings depend on how busy the machine is: the torch thread count and load average are
printed with them.

    .venv/bin/python -m benchmarks.eval_cost [--suite quick] [--policies "fp16,fp8 tensor"]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.eval_validity import POLICIES, fmt
from kvtune.autotune.evaluation import evaluate, load_suite

DEFAULT_POLICIES = ("fp16", "fp8 tensor", "fp4 g16 e4m3", "fp4 g16 + csa4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="quick", help="preset name or YAML path")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    args = parser.parse_args()
    suite = load_suite(args.suite)
    console = Console()
    results = {}
    for name in (n.strip() for n in args.policies.split(",")):
        started = time.perf_counter()
        results[name] = evaluate(POLICIES[name], suite)
        console.log(f"{name}: {time.perf_counter() - started:.1f} s")

    first = next(iter(results.values()))
    costs = Table(title=f"{suite.name} suite: cost per policy (baseline cached)")
    columns = (
        "policy",
        "seconds",
        "retention",
        "± stderr",
        "score ret.",
        "± stderr",
        "exact-match ret.",
        "KL",
        "top-1",
    )
    for column in columns:
        costs.add_column(column, justify="left" if column == "policy" else "right")
    for name, result in results.items():
        costs.add_row(
            name,
            f"{result['seconds']:.1f}",
            fmt(result["accuracy_retention"]),
            fmt(result["accuracy_retention_stderr"]),
            fmt(result["score_retention"]),
            fmt(result["score_retention_stderr"]),
            fmt(result["exact_match_retention"]),
            fmt(result["kl"], 4),
            fmt(result["top1_agreement"]),
        )
    console.print(costs)
    if first["baseline_seconds"]:
        console.print(f"baseline computed once in this run: {first['baseline_seconds']:.1f} s")

    baseline = Table(title=f"{suite.name} suite: uncompressed baseline (auto K/V) per task")
    for column in ("task", "metric", "samples", "baseline", "± stderr", "exact match", "chance"):
        baseline.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, values in first["tasks"].items():
        baseline.add_row(
            task,
            values["metric"],
            str(values["samples"]),
            fmt(values["baseline_score"]),
            fmt(values["baseline_stderr"]),
            fmt(values.get("baseline_exact_match")),
            fmt(values["chance"], 6),
        )
    console.print(baseline)
    console.print(
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
