"""Per-task scores, their bootstrap standard errors, and retention against the baseline.

A question-answering task scores exact-match accuracy (lm-eval's `acc`: the gold answer is
what greedy decoding produces); wiki_ppl scores word perplexity (lower is better). Standard
errors come from one seeded bootstrap over documents for every metric, so accuracy and
perplexity are treated alike (lm-eval reports none for perplexity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autotune.evaluation.tasks import PERPLEXITY, QA

BOOTSTRAP_ITERS = 1000

Statistic = Callable[[np.ndarray], np.ndarray]


def _mean(values: np.ndarray) -> np.ndarray:
    return values[..., 0].mean(axis=-1)


def _weighted_perplexity(values: np.ndarray) -> np.ndarray:
    """exp(-sum of log-likelihoods / sum of words) of (log-likelihood, words) pairs."""
    return np.exp(-values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1))


@dataclass(frozen=True)
class Metric:
    """A task kind's headline metric: its name in lm-eval's samples and results, its
    direction, and how per-document values aggregate."""

    name: str
    higher_is_better: bool
    statistic: Statistic

    def values(self, samples: Sequence[dict[str, Any]]) -> np.ndarray:
        """[documents, 1 or 2] per-document values as lm-eval logs them."""
        rows = [np.atleast_1d(np.asarray(sample[self.name], dtype=float)) for sample in samples]
        return np.stack(rows)


PRIMARY: dict[str, Metric] = {
    QA: Metric("acc", True, _mean),
    PERPLEXITY: Metric("word_perplexity", False, _weighted_perplexity),
}


def score(metric: Metric, values: np.ndarray) -> float:
    return float(metric.statistic(values))


def bootstrap_stderr(
    metric: Metric, values: np.ndarray, iters: int = BOOTSTRAP_ITERS, seed: int = 0
) -> float | None:
    """Standard deviation of the metric over documents resampled with replacement (None for
    fewer than two documents)."""
    count = len(values)
    if count < 2:
        return None
    indices = np.random.default_rng(seed).integers(0, count, size=(iters, count))
    return float(metric.statistic(values[indices]).std(ddof=1))


def retention(metric: Metric, policy_score: float, baseline_score: float) -> float | None:
    """Share of the baseline's quality a policy keeps: score / baseline for accuracy,
    baseline / score for perplexity. None when the baseline scores 0 (nothing to keep)."""
    if metric.higher_is_better:
        return policy_score / baseline_score if baseline_score > 0 else None
    return baseline_score / policy_score if policy_score > 0 else None


def retention_stderr(
    metric: Metric, policy_score: float, stderr: float | None, baseline_score: float
) -> float | None:
    """Standard error of retention from the policy score's, the baseline held fixed (it is
    the reference on the same documents): stderr / baseline for accuracy, and
    baseline x stderr / score^2 for perplexity (first-order)."""
    if stderr is None or retention(metric, policy_score, baseline_score) is None:
        return None
    if metric.higher_is_better:
        return stderr / baseline_score
    return baseline_score * stderr / policy_score**2


@dataclass(frozen=True)
class TaskScore:
    """One task's headline metric for one policy, over `samples` documents."""

    metric: str
    higher_is_better: bool
    score: float
    stderr: float | None
    samples: int


def task_score(
    kind: str, lm_eval_metrics: dict[str, Any], samples: Sequence[dict[str, Any]]
) -> TaskScore:
    """The task's headline score as lm-eval aggregated it, with a bootstrap stderr."""
    metric = PRIMARY[kind]
    values = metric.values(samples)
    return TaskScore(
        metric.name,
        metric.higher_is_better,
        float(lm_eval_metrics[metric.name]),
        bootstrap_stderr(metric, values),
        len(values),
    )
