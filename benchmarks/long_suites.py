"""The long suites (conf/eval/long8k.yaml, long16k.yaml) task by task: the fp16 baseline's own
scores, and optionally a policy's against it.

Each task runs as a suite of its own (the same rows: a task draws from its own seeded rng), so
its baseline lands in the content-keyed baseline cache (kvtune/autotune/evaluation/
baseline_cache.py) and a policy's result in the benchmarks' content-keyed cache
(eval_validity.cached_evaluate). Inside a task, each haystack (its prefill and the questions
answered on it) is stored as it finishes (kvtune/autotune/evaluation/unit_cache.py): an
interrupted run resumes at the haystack where it stopped, with the scores an uninterrupted run
gives.

Per task: items scored, the baseline's greedy exact match (a generation task's generated
answers, a question-answering task's teacher-forced argmax) and its headline score (the mean
gold-answer probability; word perplexity for wiki_ppl; exact match again for generation); with a
policy, its exact match and retention (exp(-KL) per answer, or the exact-match ratio for a
generation task); seconds each run took (a cached one shows the seconds it took then; a resumed
one, those of its last part).

--estimate 16384,32768 adds what the measured tasks would cost at other lengths (same items):
the seconds measured here times the ratio of prefill FLOPs per prompt, 2 x (the decoder's matmul
parameters, embeddings aside) x L for the projections plus 4 x layers x heads x head_dim x L^2 / 2
for causal attention (an estimate, not a measurement).

    .venv/bin/python -m benchmarks.long_suites [--suite long8k] [--tasks passkey_greedy,...]
        [--policy '{"k_dtype": "fp8", "v_dtype": "fp8"}'] [--estimate 16384,32768] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from benchmarks.eval_validity import cached_evaluate, fmt
from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.evaluation import EvalSuite, load_suite
from kvtune.autotune.evaluation.baseline_cache import baseline_run
from kvtune.autotune.evaluation.evaluator import eval_cache_dir
from kvtune.autotune.evaluation.task_files import task_folder
from kvtune.autotune.evaluation.tasks import PERPLEXITY, TASKS
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer


def task_suite(suite: EvalSuite, task: str) -> EvalSuite:
    """The suite with only `task` (its rows are the full suite's: each task has its own rng)."""
    data = {**suite.to_dict(), "name": f"{suite.name}/{task}"}
    data["tasks"] = {task: data["tasks"][task]}
    return load_suite(data)


@dataclass(frozen=True)
class TaskRow:
    """One task's line: the baseline's scores, and the policy's where one was given."""

    task: str
    items: int
    baseline_exact_match: float | None
    baseline_score: float
    baseline_seconds: float
    exact_match: float | None = None
    retention: float | None = None
    seconds: float | None = None


def baseline_row(suite: EvalSuite, task: str) -> TaskRow:
    """The task's baseline, from the baseline cache or computed (and stored) now."""
    sub = task_suite(suite, task)
    model_folder = resolve_model(sub.model)
    root = eval_cache_dir()
    folder = task_folder(sub, Tokenizer.from_folder(model_folder), root)
    run, _ = baseline_run(sub, folder, model_folder, root)
    score = run.tasks[task]
    return TaskRow(task, score.samples, score.exact_match, score.score, run.seconds)


def with_policy(row: TaskRow, suite: EvalSuite, policy: KVPolicy, cache: JsonCache) -> TaskRow:
    """row with the policy's exact match, retention and seconds on the task."""
    result = cached_evaluate(policy, task_suite(suite, row.task), cache)
    task = result["tasks"][row.task]
    return dataclasses.replace(
        row,
        exact_match=task.get("exact_match"),
        retention=task["retention"],
        seconds=result["seconds"],
    )


COLUMNS = (
    "task",
    "items",
    "fp16 exact match",
    "fp16 score",
    "fp16 s",
    "policy exact match",
    "retention",
    "policy s",
)


def cells(row: TaskRow) -> list[str]:
    digits = 2 if TASKS[row.task].kind == PERPLEXITY else 3
    return [
        row.task,
        str(row.items),
        fmt(row.baseline_exact_match),
        fmt(row.baseline_score, digits),
        f"{row.baseline_seconds:.0f}",
        fmt(row.exact_match),
        fmt(row.retention),
        "-" if row.seconds is None else f"{row.seconds:.0f}",
    ]


def prefill_flops(config: dict, tokens: int) -> float:
    """FLOPs of one causal prefill of `tokens` tokens (module docstring: the formula)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    matmul_params = layers * (attention + 3 * hidden * config["intermediate_size"])
    return 2.0 * matmul_params * tokens + 4.0 * layers * heads * head_dim * tokens**2 / 2


def estimates(suite: EvalSuite, rows: list[TaskRow], lengths: list[int]) -> list[str]:
    """One line per length: the measured tasks' baseline seconds scaled by the FLOP ratio."""
    config = json.loads((resolve_model(suite.model) / "config.json").read_text())
    measured = sum(row.baseline_seconds for row in rows)
    here = prefill_flops(config, suite.context_tokens)
    return [
        f"{length} tokens: {prefill_flops(config, length) / here:.2f}x the prefill FLOPs of "
        f"{suite.context_tokens}, about {measured * prefill_flops(config, length) / here:.0f} s "
        f"for {', '.join(row.task for row in rows)} (measured here: {measured:.0f} s)"
        for length in lengths
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="long8k", help="a preset or YAML file")
    parser.add_argument("--tasks", default="", help="comma-separated; default: the suite's")
    parser.add_argument("--policy", default="", help="a policy as JSON (KVPolicy fields)")
    parser.add_argument("--estimate", default="", help="comma-separated lengths (tokens)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    suite = load_suite(args.suite)
    names = [t for t in args.tasks.split(",") if t] or list(suite.tasks)
    policy = KVPolicy.from_dict(json.loads(args.policy)) if args.policy else None
    cache = JsonCache(default_cache_folder("eval-validity"))
    console = Console()
    rows = []
    for name in names:
        row = baseline_row(suite, name)
        if policy is not None:
            row = with_policy(row, suite, policy, cache)
        rows.append(row)
        console.print(" | ".join(cells(row)))
    title = f"{suite.name} ({suite.model}, {suite.context_tokens} tokens, seed {suite.seed})"
    lengths = [int(length) for length in args.estimate.split(",") if length]
    for line in estimates(suite, rows, lengths):
        console.print(f"estimate at {line}")
    if args.markdown:
        print(f"{title}\n")
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---|" * len(COLUMNS))
        for row in rows:
            print("| " + " | ".join(cells(row)) + " |")
        return
    table = Table(*COLUMNS, title=title)
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)


if __name__ == "__main__":
    main()
