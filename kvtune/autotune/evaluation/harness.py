"""Run lm-eval on a suite's generated tasks with a given model; per-task metrics and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lm_eval.api.model import LM
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from kvtune.autotune.evaluation.task_files import TaskFolder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskRun:
    """lm-eval's aggregated metrics (name -> value) and logged per-document samples."""

    metrics: dict[str, Any]
    samples: list[dict[str, Any]]


def run_tasks(lm: LM, folder: TaskFolder) -> dict[str, TaskRun]:
    """Every task of the folder through lm-eval (zero-shot, no stderr bootstrap: scoring.py
    computes its own).

    lm-eval's `evaluate`, not `simple_evaluate`: the latter also records the environment
    (torch's collect_env runs pip and nvidia-smi, ~0.8 s a trial) and shells out to git, which
    prints "fatal: not a git repository" when kvtune runs outside a checkout.
    """
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    names = {folder.lm_eval_name(task): task for task in folder.rows}
    loaded = manager.load(list(names))
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
    results = evaluate(lm=lm, task_dict=loaded, bootstrap_iters=0, log_samples=True)
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
