"""`evaluate(policy, suite)`: a KV policy's accuracy and fidelity against the uncompressed
baseline on the generated long-context suite.

accuracy_retention averages, over the probability-scored tasks, the expected likelihood ratio
exp(-KL(baseline || policy)) of each gold answer (scoring.py: the lowest-variance signal
measured where the tuner decides); the gold answer's probability, greedy exact match and the
greedy generation tasks' exact match are reported beside it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvtune.autotune.evaluation.baseline_cache import baseline_run
from kvtune.autotune.evaluation.fidelity import Key, scored_kl, task_fidelity
from kvtune.autotune.evaluation.scoring import (
    EXACT_MATCH,
    PRIMARY,
    TaskScore,
    likelihood_retention,
    likelihood_retention_stderr,
    retention,
    retention_stderr,
)
from kvtune.autotune.evaluation.suite import EvalSuite, load_suite
from kvtune.autotune.evaluation.suite_run import SuiteRun, run_suite
from kvtune.autotune.evaluation.task_files import TaskFolder, task_folder
from kvtune.autotune.evaluation.tasks import GENERATION, PERPLEXITY, QA, TASKS
from kvtune.autotune.evaluation.unit_cache import UnitCache, unit_folder
from kvtune.cache_root import cache_dir
from kvtune.runtime.llm import as_policy
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FIDELITY_KEYS = ("kl", "kl_prompt_tail", "top1_agreement", "answer_agreement")


def eval_cache_dir() -> Path:
    """Generated tasks, cached baselines and unfinished runs' units: <kvtune cache>/eval."""
    return cache_dir() / "eval"


def evaluate(
    policy: KVPolicy | Mapping[str, Any] | None = None,
    suite: EvalSuite | Mapping[str, Any] | str = "quick",
    cache: Path | None = None,
) -> dict[str, Any]:
    """Score a KV policy on a suite (a preset name such as "quick" or "full", a dict, or an
    EvalSuite) against the uncompressed baseline.

    Returns a plain dict (JSON-ready): `tasks` (per task: metric, score, stderr,
    baseline_score, retention and its bootstrap stderr, score_retention with its paired
    stderr, greedy exact match, chance, fidelity), `accuracy_retention` (mean over the
    probability-scored tasks of exp(-KL(baseline || policy)) per gold answer, per token for
    perplexity: scoring.py says why) and `accuracy_retention_stderr` (propagated),
    `score_retention` (mean of policy / baseline score, baseline / policy for perplexity),
    `exact_match_retention` (mean over QA tasks of greedy exact-match retention),
    `generation_exact_match_retention` (the greedy generation tasks, beside and not inside
    accuracy_retention), `kv_clipped_fraction` (K/V values beyond a per-tensor or
    E4M3-scaled stream's range, None without such streams), `kl`, `kl_prompt_tail`,
    `top1_agreement`,
    `answer_agreement` (means over tasks), `seconds` (this policy's cost: loading and
    scoring) and `baseline_seconds` (the baseline's, when it was not cached); a resumed run
    counts the units it read back at what they took when computed.

    A killed evaluation, baseline or policy, resumes at the runtime call (at long contexts, the
    haystack) where it stopped: each is stored as it finishes (unit_cache.py).

        evaluate({"k_dtype": "fp8", "v_dtype": "fp8"}, "quick")["accuracy_retention"]
    """
    started = time.perf_counter()
    suite = load_suite(suite)
    policy = as_policy(policy)
    root = cache or eval_cache_dir()
    model_folder = resolve_model(suite.model)
    folder = task_folder(suite, Tokenizer.from_folder(model_folder), root)
    baseline_started = time.perf_counter()
    baseline, computed = baseline_run(suite, folder, model_folder, root)
    baseline_wall = time.perf_counter() - baseline_started if computed else 0.0
    units = UnitCache(unit_folder(root))
    run = run_suite(policy, suite, folder, reference=baseline.rows, units=units)
    result = report(suite, policy, folder, baseline, run)
    elapsed = time.perf_counter() - started
    result["seconds"] = elapsed - baseline_wall + run.read_back_seconds
    result["baseline_seconds"] = baseline.seconds if computed else 0.0
    units.forget()  # the caller stores the whole result (studies, benchmarks' cached_evaluate)
    logger.info(
        "%s suite: retention %.3f, KL %.4f in %.1f s",
        suite.name,
        result["accuracy_retention"] or 0.0,
        result["kl"] or 0.0,
        result["seconds"],
    )
    return result


def _task_keys(folder: TaskFolder, task: str, recorded: Iterable[Key]) -> list[Key]:
    """Recorded request keys of one task: their first element is one of its prompts (QA) or
    documents (perplexity)."""
    field = "text" if TASKS[task].kind == PERPLEXITY else "context"
    prompts = {row[field] for row in folder.rows[task]}
    return [key for key in recorded if key[0] in prompts]


def _sample_keys(folder: TaskFolder, task: str, recorded: Iterable[Key]) -> list[list[Key]]:
    """Per sample of a probability-scored task, in document order: the request keys that
    scored it (a question's one request; a document's rolling windows, in order)."""
    if TASKS[task].kind == QA:
        return [[(row["context"], row["answer"])] for row in folder.rows[task]]
    windows: dict[str, list[Key]] = {row["text"]: [] for row in folder.rows[task]}
    for key in recorded:
        if key[0] in windows:
            windows[key[0]].append(key)
    return [sorted(keys, key=lambda k: int(k[1])) for keys in windows.values()]


def _likelihood_retention(
    folder: TaskFolder, task: str, baseline: SuiteRun, run: SuiteRun
) -> dict[str, float | None]:
    """The headline retention of a probability-scored task and its bootstrap stderr."""
    kind = TASKS[task].kind
    values = scored_kl(baseline.rows, run.rows, _sample_keys(folder, task, run.rows))
    if values is None:
        return {"retention": None, "retention_stderr": None}
    return {
        "retention": likelihood_retention(kind, values),
        "retention_stderr": likelihood_retention_stderr(kind, values),
    }


def _retentions(
    folder: TaskFolder, task: str, baseline: SuiteRun, run: SuiteRun
) -> dict[str, float | None]:
    """A task's retention with its stderr, and for a probability-scored task its score
    retention beside it (a generation task's retention is its exact-match ratio)."""
    metric = PRIMARY[TASKS[task].kind]
    score, base = run.tasks[task], baseline.tasks[task]
    by_score = retention(metric, score.score, base.score)
    stderr = retention_stderr(metric, np.asarray(score.values), np.asarray(base.values))
    if TASKS[task].kind == GENERATION:
        return {"retention": by_score, "retention_stderr": stderr}
    return {
        **_likelihood_retention(folder, task, baseline, run),
        "score_retention": by_score,
        "score_retention_stderr": stderr,
    }


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _mean_stderr(stderrs: Iterable[float | None]) -> float | None:
    """Standard error of a mean of independent estimates with these standard errors."""
    values = list(stderrs)
    if not values or any(v is None for v in values):
        return None
    return math.sqrt(sum(v * v for v in values)) / len(values)


def _exact_match(score: TaskScore, base: TaskScore) -> dict[str, float | None]:
    """Greedy exact match of a QA task next to its headline score (empty for perplexity)."""
    if score.exact_match is None or base.exact_match is None:
        return {}
    return {
        "exact_match": score.exact_match,
        "baseline_exact_match": base.exact_match,
        "exact_match_retention": retention(EXACT_MATCH, score.exact_match, base.exact_match),
    }


def report(
    suite: EvalSuite, policy: KVPolicy, folder: TaskFolder, baseline: SuiteRun, run: SuiteRun
) -> dict[str, Any]:
    """The result dict of one policy's run against the baseline's."""
    tasks: dict[str, dict[str, Any]] = {}
    for name, score in run.tasks.items():
        base = baseline.tasks[name]
        task = TASKS[name]
        keys = _task_keys(folder, name, run.rows)
        tasks[name] = {
            "metric": score.metric,
            "higher_is_better": score.higher_is_better,
            "score": score.score,
            "stderr": score.stderr,
            "baseline_score": base.score,
            "baseline_stderr": base.stderr,
            **_retentions(folder, name, baseline, run),
            **_exact_match(score, base),
            "samples": score.samples,
            "chance": task.chance,
            **task_fidelity(baseline.rows, run.rows, keys, answers=task.kind != PERPLEXITY),
        }
    scored = {name: t for name, t in tasks.items() if TASKS[name].kind != GENERATION}
    generated = [t for name, t in tasks.items() if TASKS[name].kind == GENERATION]
    return {
        "suite": suite.name,
        "model": suite.model,
        "seed": suite.seed,
        "context_tokens": suite.context_tokens,
        "policy": policy.to_dict(),
        "tasks": tasks,
        "accuracy_retention": _mean(t["retention"] for t in scored.values()),
        "accuracy_retention_stderr": _mean_stderr(
            t["retention_stderr"] for t in scored.values() if t["retention"] is not None
        ),
        "score_retention": _mean(t["score_retention"] for t in scored.values()),
        "score_retention_stderr": _mean_stderr(
            t["score_retention_stderr"] for t in scored.values() if t["score_retention"] is not None
        ),
        "exact_match_retention": _mean(t.get("exact_match_retention") for t in scored.values()),
        "generation_exact_match_retention": _mean(t["retention"] for t in generated),
        "kv_clipped_fraction": run.clipped_fraction,
        **{key: _mean(t[key] for t in tasks.values()) for key in FIDELITY_KEYS},
    }
