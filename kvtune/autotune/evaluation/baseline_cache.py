"""The uncompressed baseline's results, computed once per model, suite and code, then reused.

Every trial compares against the same baseline (auto K/V dtypes: the model's own precision, no
compression), so it is scored once and stored under the kvtune cache as
baselines/<key>.pt; a trial then pays only for its own policy. The key is content only: the
model files' hash, the suite's fingerprint (every setting but its name and model, and the task
rows it generated), the baseline policy and the fingerprint of the code that scores it. While it
runs, each finished haystack is stored in the unit cache (unit_cache.py, under <root>/units), so
a killed baseline resumes at the haystack where it stopped; once stored whole, those go.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvtune.autotune.cache import ACCURACY_CODE, code_key, key_digest, replace_atomically
from kvtune.autotune.evaluation.fidelity import ScoredRows
from kvtune.autotune.evaluation.scoring import TaskScore
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.suite_run import SuiteRun, run_suite
from kvtune.autotune.evaluation.task_files import TaskFolder, task_folder
from kvtune.autotune.evaluation.unit_cache import UnitCache, unit_folder
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BASELINE_POLICY = KVPolicy(k_dtype="auto", v_dtype="auto", csa_ratio=1)
# Named elsewhere in a key by content (the model's files hash), or not deciding scores.
IDENTITY_FIELDS = ("name", "model")


def suite_fingerprint(suite: EvalSuite, folder: TaskFolder) -> str:
    """Content hash of a suite: its full definition except its name and model, and the task
    rows it generated (so a changed generator misses even under the same settings)."""
    definition = {k: v for k, v in suite.to_dict().items() if k not in IDENTITY_FIELDS}
    text = json.dumps({"definition": definition, "rows": folder.rows}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def suite_content_fingerprint(suite: EvalSuite, root: Path) -> str:
    """suite_fingerprint of the suite's task folder under root (written on first use)."""
    model_folder = resolve_model(suite.model)
    return suite_fingerprint(suite, task_folder(suite, Tokenizer.from_folder(model_folder), root))


def baseline_key(suite: EvalSuite, folder: TaskFolder, model_folder: Path) -> dict[str, Any]:
    return {
        "kind": "baseline",
        "model": model_fingerprint(model_folder),
        "suite": suite_fingerprint(suite, folder),
        "policy": BASELINE_POLICY.to_dict(),
        "code": code_key(*ACCURACY_CODE),
    }


def save(path: Path, run: SuiteRun) -> None:
    """Write atomically (temporary file renamed), so a reader never sees half a file."""
    data = {
        "tasks": {name: dataclasses.asdict(score) for name, score in run.tasks.items()},
        "rows": [[list(key), rows.to_dict()] for key, rows in run.rows.items()],
        "seconds": run.seconds,
    }
    replace_atomically(path, lambda temporary: torch.save(data, temporary))


def load(path: Path) -> SuiteRun:
    data = torch.load(path, weights_only=True)
    rows = {tuple(key): ScoredRows(**fields) for key, fields in data["rows"]}
    tasks = {name: TaskScore(**fields) for name, fields in data["tasks"].items()}
    return SuiteRun(tasks, rows, data["seconds"])


def baseline_run(
    suite: EvalSuite, folder: TaskFolder, model_folder: Path, root: Path
) -> tuple[SuiteRun, bool]:
    """(the baseline's run, whether it was computed now rather than read from the cache)."""
    path = root / "baselines" / f"{key_digest(baseline_key(suite, folder, model_folder))[:16]}.pt"
    if path.is_file():
        return load(path), False
    logger.info("scoring the uncompressed baseline once for the %s suite", suite.name)
    units = UnitCache(unit_folder(root))
    run = run_suite(BASELINE_POLICY, suite, folder, units=units)
    save(path, run)
    units.forget()
    return run, True
