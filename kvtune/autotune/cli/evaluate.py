"""`kvtune evaluate`: score a KV policy on an accuracy suite against the uncompressed baseline.

    kvtune evaluate policy.k_dtype=fp8 policy.v_dtype=fp4 eval=quick format=json
    kvtune evaluate eval=full eval.context_tokens=4096 model.path=/models/my-llama

The evaluation (torch, lm-eval) is imported when the command runs, so the other commands
start quickly.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich import box
from rich.console import Console
from rich.table import Table

from kvtune.autotune.config.settings import build_model_arch, build_policy
from kvtune.runtime.errors import ConfigError

FORMATS = ("table", "json")


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _exact_match(task: dict[str, Any]) -> str:
    """'policy / baseline' greedy exact match of a QA task; '-' for perplexity."""
    if task.get("exact_match") is None:
        return "-"
    return f"{task['exact_match']:.2f}/{task['baseline_exact_match']:.2f}"


def render_result(result: dict[str, Any], console: Console) -> None:
    """Per-task scores next to the baseline's, then the suite-wide figures."""
    table = Table(
        title=f"kvtune evaluate: {result['suite']} suite, {result['model']}",
        box=box.SIMPLE,
        pad_edge=False,
        collapse_padding=True,
    )
    columns = ("task", "score", "± stderr", "baseline", "retention", "exact match")
    for column in (*columns, "KL", "top-1"):
        table.add_column(
            column, justify="left" if column == "task" else "right", min_width=len(column)
        )
    for name, task in result["tasks"].items():
        table.add_row(
            name,
            _number(task["score"]),
            _number(task["stderr"]),
            _number(task["baseline_score"]),
            _number(task["retention"]),
            _exact_match(task),
            _number(task["kl"], 4),
            _number(task["top1_agreement"]),
        )
    console.print(table)
    metrics = sorted({task["metric"] for task in result["tasks"].values()})
    console.print(f"score: {', '.join(metrics)}; exact match: greedy, policy/baseline")
    console.print(
        f"accuracy retention {_number(result['accuracy_retention'])} "
        f"(exact match {_number(result['exact_match_retention'])}), "
        f"KL {_number(result['kl'], 4)}, top-1 agreement {_number(result['top1_agreement'])}, "
        f"answer agreement {_number(result['answer_agreement'])}, "
        f"{result['seconds']:.1f} s (baseline {result['baseline_seconds']:.1f} s)"
    )


def evaluated_model(cfg: DictConfig, command_line: Sequence[str]) -> str:
    """The model as every command takes it (model=<preset> or model.path=<folder>); the eval
    preset's `model` is refused on the command line so that there is one spelling."""
    for override in command_line:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "eval.model":
            raise ConfigError(
                "eval.model",
                value,
                "not a setting of kvtune evaluate: give model.path=<folder> or model=<preset>, "
                "as for kvtune tune and plan",
            )
    return str(cfg.model.get("path") or cfg.model.name)


def evaluate_task(cfg: DictConfig) -> None:
    """`kvtune evaluate`: print the evaluation as a table or one JSON object."""
    if cfg.format not in FORMATS:
        raise ConfigError("format", cfg.format, f"one of {', '.join(FORMATS)}")
    command_line = HydraConfig.get().overrides.task
    model = evaluated_model(cfg, command_line)
    policy = build_policy(cfg.policy)
    policy.check_model(build_model_arch(cfg.model, command_line))

    from kvtune.autotune.evaluation import evaluate, load_suite

    suite = load_suite({**OmegaConf.to_container(cfg.eval, resolve=True), "model": model})
    policy.check_context(suite.context_tokens, "eval.context_tokens")
    # Libraries may print; stdout carries only the result.
    cache = Path(cfg.cache).expanduser() if cfg.cache else None
    with contextlib.redirect_stdout(sys.stderr):
        result = evaluate(policy, suite, cache)
    if cfg.format == "json":
        print(json.dumps(result))
    else:
        render_result(result, Console())
