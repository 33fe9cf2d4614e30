"""The uncompressed baseline's results, computed once per model, suite and seed, then reused.

Every trial compares against the same baseline (auto K/V dtypes: the model's own precision, no
compression), so it is scored once and stored under the kvtune cache as
baselines/<key>.pt; a trial then pays only for its own policy. The key hashes the model
folder, every suite setting but its name (seed, lengths, sizes, runtime), the baseline policy
and the formats of the task files and of this file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from autotune.evaluation import task_files
from autotune.evaluation.fidelity import ScoredRows
from autotune.evaluation.scoring import TaskScore
from autotune.evaluation.suite import EvalSuite
from autotune.evaluation.suite_run import SuiteRun, run_suite
from autotune.evaluation.task_files import TaskFolder
from runtime.policy import KVPolicy

logger = logging.getLogger(__name__)

BASELINE_POLICY = KVPolicy(k_dtype="auto", v_dtype="auto", csa_ratio=1)
FORMAT_VERSION = 2  # bump when SuiteRun's stored fields change


def baseline_key(suite: EvalSuite, model_folder: Path) -> str:
    data = {
        "suite": suite.run_fingerprint(),
        "model": str(model_folder),
        "policy": BASELINE_POLICY.to_dict(),
        "versions": [task_files.FORMAT_VERSION, FORMAT_VERSION],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def save(path: Path, run: SuiteRun) -> None:
    """Write atomically (temporary file renamed), so a reader never sees half a file."""
    data = {
        "tasks": {name: dataclasses.asdict(score) for name, score in run.tasks.items()},
        "rows": [[list(key), rows.to_dict()] for key, rows in run.rows.items()],
        "seconds": run.seconds,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    torch.save(data, temporary)
    os.replace(temporary, path)


def load(path: Path) -> SuiteRun:
    data = torch.load(path, weights_only=True)
    rows = {tuple(key): ScoredRows(**fields) for key, fields in data["rows"]}
    tasks = {name: TaskScore(**fields) for name, fields in data["tasks"].items()}
    return SuiteRun(tasks, rows, data["seconds"])


def baseline_run(
    suite: EvalSuite, folder: TaskFolder, model_folder: Path, root: Path
) -> tuple[SuiteRun, bool]:
    """(the baseline's run, whether it was computed now rather than read from the cache)."""
    path = root / "baselines" / f"{baseline_key(suite, model_folder)}.pt"
    if path.is_file():
        return load(path), False
    logger.info("scoring the uncompressed baseline once for the %s suite", suite.name)
    run = run_suite(BASELINE_POLICY, suite, folder)
    save(path, run)
    return run, True
