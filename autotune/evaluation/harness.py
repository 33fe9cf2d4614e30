"""Run lm-eval on a suite's generated tasks with a given model; per-task metrics and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import lm_eval
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from autotune.evaluation.task_files import TaskFolder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskRun:
    """lm-eval's aggregated metrics (name -> value) and logged per-document samples."""

    metrics: dict[str, Any]
    samples: list[dict[str, Any]]


def run_tasks(lm: LM, folder: TaskFolder) -> dict[str, TaskRun]:
    """Every task of the folder through `lm_eval.simple_evaluate` (zero-shot, no stderr
    bootstrap: scoring.py computes its own)."""
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    names = {folder.lm_eval_name(task): task for task in folder.rows}
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(names),
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=True,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    runs = {}
    for lm_eval_name, task in names.items():
        metrics = {
            key.split(",")[0]: value
            for key, value in results["results"][lm_eval_name].items()
            if "," in key and "_stderr" not in key
        }
        runs[task] = TaskRun(metrics, results["samples"][lm_eval_name])
    return runs
