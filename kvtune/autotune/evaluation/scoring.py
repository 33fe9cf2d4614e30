"""Per-task scores, their bootstrap standard errors, and retention against the baseline.

Retention (accuracy_retention's parts) is the policy's expected likelihood of the baseline's
answers relative to the baseline's own: exp(-KL(baseline || policy)), the KL of the next-token
distributions summed over each gold answer's tokens (teacher-forced) and averaged over
questions, or per token over a perplexity document. If the gold answer were drawn from the
baseline's distribution, this is what the teacher-forced log-likelihood ratio of the gold
answer averages to; using the expectation instead of the one drawn answer removes the noise of
which token happens to be gold, the term that dominates near the top of the front. Measured on
the quick suite (benchmarks/eval_signals.py, RESULTS.md "Accuracy signals"): fp8 g32 and K fp8 / V
fp4 g32 differ by 0.032 ± 0.007 in this retention, by 0.024 ± 0.040 in the gold answer's probability
and by -0.015 ± 0.037 in its log-likelihood. It cannot exceed 1: a policy that moves
probability onto the gold answer by chance is not better, only different.

The task scores are kept beside it: a question-answering task scores the mean probability the
model gives the gold answer (exp of lm-eval's per-sample log-likelihood), with greedy exact
match (lm-eval's `acc`); wiki_ppl word perplexity (lower is better); a generation task greedy
exact match of the generated text. score / baseline (baseline / score for perplexity) is
reported as score retention, the headline before 2026-12-02.

Standard errors come from one seeded bootstrap over samples for every metric. Score
retention's is a paired bootstrap: the policy and the baseline answer the same questions, so
each resample draws the same samples for both. KL is a paired quantity already.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.autotune.evaluation.tasks import GENERATION, PERPLEXITY, QA

BOOTSTRAP_ITERS = 1000

Statistic = Callable[[np.ndarray], np.ndarray]
SampleValue = Callable[[dict[str, Any]], list[float]]


def _mean(values: np.ndarray) -> np.ndarray:
    return values[..., 0].mean(axis=-1)


def _weighted_perplexity(values: np.ndarray) -> np.ndarray:
    """exp(-sum of log-likelihoods / sum of words) of (log-likelihood, words) pairs."""
    return np.exp(-values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1))


def _answer_probability(sample: dict[str, Any]) -> list[float]:
    # lm-eval's per-sample "perplexity" of a loglikelihood task is the answer's log-likelihood.
    return [math.exp(float(sample["perplexity"]))]


def _greedy_match(sample: dict[str, Any]) -> list[float]:
    return [float(sample["acc"])]


def _generated_match(sample: dict[str, Any]) -> list[float]:
    return [float(sample["exact_match"])]


def _loglikelihood_and_words(sample: dict[str, Any]) -> list[float]:
    return [float(value) for value in sample["word_perplexity"]]


@dataclass(frozen=True)
class Metric:
    """A score: its name, its direction, what it reads from each lm-eval sample, and how
    per-sample values aggregate."""

    name: str
    higher_is_better: bool
    per_sample: SampleValue
    statistic: Statistic

    def values(self, samples: Sequence[dict[str, Any]]) -> np.ndarray:
        """[samples, 1 or 2] per-sample values, in lm-eval's document order."""
        ordered = sorted(samples, key=lambda sample: sample["doc_id"])
        return np.array([self.per_sample(sample) for sample in ordered], dtype=float)


PRIMARY: dict[str, Metric] = {
    QA: Metric("answer_probability", True, _answer_probability, _mean),
    PERPLEXITY: Metric("word_perplexity", False, _loglikelihood_and_words, _weighted_perplexity),
    GENERATION: Metric("exact_match", True, _generated_match, _mean),
}
EXACT_MATCH = Metric("exact_match", True, _greedy_match, _mean)


def score(metric: Metric, values: np.ndarray) -> float:
    return float(metric.statistic(values))


def _resamples(count: int, iters: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, count, size=(iters, count))


def bootstrap_stderr(
    metric: Metric, values: np.ndarray, iters: int = BOOTSTRAP_ITERS, seed: int = 0
) -> float | None:
    """Standard deviation of the metric over samples resampled with replacement (None for
    fewer than two samples)."""
    if len(values) < 2:
        return None
    return float(metric.statistic(values[_resamples(len(values), iters, seed)]).std(ddof=1))


def _ratio(metric: Metric, policy: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """score / baseline for higher-is-better metrics, baseline / score otherwise."""
    if metric.higher_is_better:
        return policy / baseline
    return baseline / policy


def retention(metric: Metric, policy_score: float, baseline_score: float) -> float | None:
    """Share of the baseline's quality a policy keeps: score / baseline for accuracy,
    baseline / score for perplexity. None when the denominator is 0 (nothing to keep)."""
    denominator = baseline_score if metric.higher_is_better else policy_score
    if denominator <= 0:
        return None
    return float(_ratio(metric, np.float64(policy_score), np.float64(baseline_score)))


def retention_stderr(
    metric: Metric,
    policy_values: np.ndarray,
    baseline_values: np.ndarray,
    iters: int = BOOTSTRAP_ITERS,
    seed: int = 0,
) -> float | None:
    """Paired bootstrap standard error of retention: each resample draws the same samples for
    the policy and the baseline. None for fewer than two samples or a zero denominator."""
    if len(policy_values) != len(baseline_values):
        raise ValueError("policy and baseline must score the same samples")
    if len(policy_values) < 2:
        return None
    indices = _resamples(len(policy_values), iters, seed)
    policy = metric.statistic(policy_values[indices])
    baseline = metric.statistic(baseline_values[indices])
    denominator = baseline if metric.higher_is_better else policy
    usable = denominator > 0
    if not usable.any():
        return None
    return float(_ratio(metric, policy[usable], baseline[usable]).std(ddof=1))


def _expected_answer_likelihood(values: np.ndarray) -> np.ndarray:
    """exp(-mean over questions of the KL summed over each answer's tokens)."""
    return np.exp(-values[..., 0].mean(axis=-1))


def _expected_token_likelihood(values: np.ndarray) -> np.ndarray:
    """exp(-KL per token) over all scored tokens of all documents."""
    return np.exp(-values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1))


# Fidelity retention per task kind, from [samples, (KL summed over the scored positions,
# positions)] (fidelity.scored_kl).
EXPECTED_LIKELIHOOD: dict[str, Statistic] = {
    QA: _expected_answer_likelihood,
    PERPLEXITY: _expected_token_likelihood,
}


def likelihood_retention(kind: str, kl_values: np.ndarray) -> float:
    """The policy's expected likelihood of what the baseline would answer, relative to the
    baseline's own: exp(-KL(baseline || policy)) per answer (QA) or per token (perplexity)."""
    return float(EXPECTED_LIKELIHOOD[kind](kl_values))


def likelihood_retention_stderr(
    kind: str, kl_values: np.ndarray, iters: int = BOOTSTRAP_ITERS, seed: int = 0
) -> float | None:
    """Bootstrap standard error over samples. KL is already a paired quantity (the policy
    against the baseline on the same prompt), so a plain resample is the paired bootstrap."""
    if len(kl_values) < 2:
        return None
    draws = EXPECTED_LIKELIHOOD[kind](kl_values[_resamples(len(kl_values), iters, seed)])
    return float(draws.std(ddof=1))


@dataclass(frozen=True)
class TaskScore:
    """One task's headline metric for one policy over `samples` samples.

    values: per-sample values of the headline metric (for the paired retention bootstrap).
    exact_match / exact_match_values: greedy exact-match rate and per-sample matches (QA).
    """

    metric: str
    higher_is_better: bool
    score: float
    stderr: float | None
    samples: int
    values: list[list[float]]
    exact_match: float | None = None
    exact_match_values: list[list[float]] | None = None


def task_score(kind: str, samples: Sequence[dict[str, Any]]) -> TaskScore:
    """The task's headline score from lm-eval's logged samples, with a bootstrap stderr."""
    metric = PRIMARY[kind]
    values = metric.values(samples)
    matches = None
    if kind == QA:
        matches = EXACT_MATCH.values(samples)
    elif kind == GENERATION:  # the headline is exact match already
        matches = values
    return TaskScore(
        metric.name,
        metric.higher_is_better,
        score(metric, values),
        bootstrap_stderr(metric, values),
        len(values),
        values.tolist(),
        None if matches is None else score(EXACT_MATCH, matches),
        None if matches is None else matches.tolist(),
    )
