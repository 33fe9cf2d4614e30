"""One policy through the whole suite: load the runtime, run lm-eval, score, record fidelity.

With a unit cache, every runtime call is stored as it finishes (unit_cache.py), so a rerun
after a kill computes only the calls the killed run had not finished, with the same scores.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvtune.autotune.evaluation.fidelity import FidelityRecorder, Key, ScoredRows
from kvtune.autotune.evaluation.harness import run_tasks
from kvtune.autotune.evaluation.lm_backend import KVTuneLM
from kvtune.autotune.evaluation.scoring import TaskScore, task_score
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import TaskFolder
from kvtune.autotune.evaluation.tasks import TASKS
from kvtune.autotune.evaluation.unit_cache import UnitCache
from kvtune.runtime.policy import KVPolicy


@dataclass(frozen=True)
class SuiteRun:
    """Scores per task, compact next-token distributions per request, what the run cost (s:
    its wall time plus, when it resumed a killed one, what the units it read back took when
    computed: about an uninterrupted run's time), of that the read-back units' share, and the
    fraction of written K/V values beyond their stream's range (None: no stream has a fixed
    range; kvtune/runtime/clip_counter.py)."""

    tasks: dict[str, TaskScore]
    rows: dict[Key, ScoredRows]
    seconds: float
    clipped_fraction: float | None = None
    read_back_seconds: float = 0.0


def run_suite(
    policy: KVPolicy,
    suite: EvalSuite,
    folder: TaskFolder,
    reference: Mapping[Key, ScoredRows] | None = None,
    units: UnitCache | None = None,
) -> SuiteRun:
    """Score `policy` on the suite's tasks; with a reference, record fidelity against it; with
    units, store each runtime call as it finishes and read back those a killed run stored."""
    started = time.perf_counter()
    recorder = FidelityRecorder(reference)
    lm = KVTuneLM(
        suite.model,
        policy,
        backend=suite.backend,
        device=suite.device,
        dtype=suite.dtype,
        max_num_seqs=suite.max_num_seqs,
        max_model_len=folder.max_tokens,
        batch_tokens=suite.batch_tokens,
        kl_tail_tokens=suite.kl_tail_tokens,
        observer=recorder,
        units=units,
    )
    runs = run_tasks(lm, folder)
    scores = {task: task_score(TASKS[task].kind, run.samples) for task, run in runs.items()}
    checked = lm.runs.range_checked_values
    clipped = lm.runs.clipped_values / checked if checked else None
    read_back = lm.runs.read_back_seconds
    seconds = time.perf_counter() - started + read_back
    return SuiteRun(scores, recorder.rows, seconds, clipped, read_back)
