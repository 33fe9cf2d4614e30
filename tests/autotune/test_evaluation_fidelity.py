"""Fidelity metrics: the top-k KL against the exact one, agreement, the per-task summary, and
the expected-likelihood retention built on it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtune.autotune.evaluation.evaluator import report
from kvtune.autotune.evaluation.fidelity import (
    FidelityRecorder,
    coarse_kl,
    scored_kl,
    task_fidelity,
)
from kvtune.autotune.evaluation.scoring import (
    likelihood_retention,
    likelihood_retention_stderr,
    task_score,
)
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.suite_run import SuiteRun
from kvtune.autotune.evaluation.task_files import TaskFolder
from kvtune.autotune.evaluation.tasks import GENERATION, PERPLEXITY, QA
from kvtune.runtime.policy import KVPolicy


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def exact_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def record(logprobs_by_key, reference=None, top_k=8, num_tail=0):
    recorder = FidelityRecorder(reference, top_k=top_k)
    for key, logprobs in logprobs_by_key.items():
        recorder.keep(key, recorder.measure(key, logprobs, num_tail))
    return recorder.rows


@pytest.fixture()
def pair():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 50, generator=generator) * 3
    noisy = base + torch.randn(6, 50, generator=generator) * 0.5
    return log_probs(base), log_probs(noisy)


def test_kl_over_the_whole_vocabulary_is_exact(pair):
    reference, policy = pair
    ref = record({("a",): reference}, top_k=50)
    pol = record({("a",): policy}, reference=ref, top_k=50)
    kl = coarse_kl(ref[("a",)], pol[("a",)].at_reference)
    torch.testing.assert_close(kl, exact_kl(reference, policy), atol=1e-5, rtol=1e-4)


def test_top_k_kl_is_a_lower_bound_and_zero_for_identical(pair):
    reference, policy = pair
    ref = record({("a",): reference}, top_k=8)
    pol = record({("a",): policy}, reference=ref, top_k=8)
    kl = coarse_kl(ref[("a",)], pol[("a",)].at_reference)
    exact = exact_kl(reference, policy)
    assert torch.all(kl <= exact + 1e-6)
    assert torch.all(kl > 0.2 * exact)  # concentrated rows: most of the divergence is seen
    same = record({("a",): reference}, reference=ref, top_k=8)
    assert float(coarse_kl(ref[("a",)], same[("a",)].at_reference).max()) < 1e-6


def test_task_fidelity_splits_prompt_tail_and_answers(pair):
    reference, policy = pair
    # Rows 0-1 are prompt tail, 2-5 the answer; the policy flips the answer's last top-1.
    policy = policy.clone()
    policy[5] = log_probs(-reference[5].exp() * 50)
    ref = record({("q", "a"): reference}, num_tail=2)
    pol = record({("q", "a"): policy}, reference=ref, num_tail=2)
    result = task_fidelity(ref, pol, [("q", "a")], answers=True)
    kl = coarse_kl(ref[("q", "a")], pol[("q", "a")].at_reference)
    assert result["kl"] == pytest.approx(float(kl[2:].mean()))
    assert result["kl_prompt_tail"] == pytest.approx(float(kl[:2].mean()))
    agree = reference.argmax(-1) == policy.argmax(-1)
    assert result["top1_agreement"] == pytest.approx(float(agree[2:].float().mean()))
    assert result["answer_agreement"] == 0.0
    assert task_fidelity(ref, pol, [("q", "a")], answers=False)["answer_agreement"] is None


def test_requests_missing_from_the_reference_are_skipped(pair):
    reference, _ = pair
    ref = record({("x",): reference})
    pol = record({("y",): reference}, reference=ref)
    assert task_fidelity(ref, pol, [("y",)], answers=True)["kl"] is None


def test_scored_kl_sums_each_samples_answer_positions_over_its_requests(pair):
    reference, policy = pair
    # Sample 1: one request (2 tail rows, 4 answer rows); sample 2: two rolling windows.
    ref = record({("q", "a"): reference}, top_k=50, num_tail=2)
    ref |= record({("doc", "0"): reference[:3], ("doc", "1"): reference[3:]}, top_k=50)
    pol = record({("q", "a"): policy}, reference=ref, top_k=50, num_tail=2)
    pol |= record({("doc", "0"): policy[:3], ("doc", "1"): policy[3:]}, reference=ref, top_k=50)
    values = scored_kl(ref, pol, [[("q", "a")], [("doc", "0"), ("doc", "1")]])
    exact = exact_kl(reference, policy)  # whole vocabulary: the oracle
    np.testing.assert_allclose(
        values, [[float(exact[2:].sum()), 4], [float(exact.sum()), 6]], rtol=1e-4
    )
    assert scored_kl(ref, pol, [[("missing",)]]) is None


def test_expected_likelihood_retention_is_the_mean_log_likelihood_ratio_of_sampled_answers():
    """exp(-KL(p || q)) is what the teacher-forced likelihood ratio q(y) / p(y) of an answer y
    averages to (in log space) when y is drawn from the baseline p: sample gold tokens from p
    and compare."""
    generator = torch.Generator().manual_seed(1)
    p = log_probs(torch.randn(3, 40, generator=generator) * 2)  # 3 answer tokens
    q = log_probs(p + torch.randn(3, 40, generator=generator) * 0.3)
    ref = record({("q", "a"): p}, top_k=40)
    pol = record({("q", "a"): q}, reference=ref, top_k=40)
    kl_values = scored_kl(ref, pol, [[("q", "a")]])
    draws = torch.multinomial(p.exp(), 200_000, replacement=True, generator=generator)
    sampled = (q.gather(1, draws) - p.gather(1, draws)).sum(0)  # log q(y) - log p(y) per answer
    expected = math.exp(float(sampled.mean()))
    assert likelihood_retention(QA, kl_values) == pytest.approx(expected, abs=2e-3)


def test_expected_likelihood_retention_per_answer_and_per_token():
    answers = np.array([[0.1, 3], [0.3, 7]])  # (KL summed over the answer, its tokens)
    assert likelihood_retention(QA, answers) == pytest.approx(math.exp(-0.2))
    assert likelihood_retention(PERPLEXITY, answers) == pytest.approx(math.exp(-0.4 / 10))
    identical = np.zeros((5, 2)) + [0.0, 4]
    assert likelihood_retention(QA, identical) == 1.0
    assert likelihood_retention_stderr(QA, identical) == 0.0
    assert likelihood_retention_stderr(QA, answers[:1]) is None
    rng = np.random.default_rng(0)
    spread = np.stack([rng.exponential(0.05, 400), np.full(400, 5.0)], axis=1)
    # Small KL: retention ~ 1 - mean, so the stderr is about the KL's own standard error.
    analytic = spread[:, 0].std() / math.sqrt(len(spread)) * likelihood_retention(QA, spread)
    assert likelihood_retention_stderr(QA, spread) == pytest.approx(analytic, rel=0.15)


def test_report_averages_the_expected_likelihood_over_tasks_with_the_score_beside(tmp_path):
    """report() on hand-made runs: the headline against exact full-vocabulary KL computed here,
    the gold-answer probability ratio beside it, the greedy needle outside the average."""
    generator = torch.Generator().manual_seed(2)
    vocab = 24  # <= the recorder's top k: its KL is the exact one
    rows = {
        "multikey": [{"context": f"c{i}", "answer": f"a{i}"} for i in range(3)],
        "wiki_ppl": [{"text": f"t{i}"} for i in range(2)],
        "passkey_greedy": [{"context": f"n{i}", "answer": "1"} for i in range(2)],
    }
    keys = [("c0", "a0"), ("c1", "a1"), ("c2", "a2"), ("t0", "0"), ("t1", "0")]
    lengths = [2, 3, 4, 6, 5]  # answer / document tokens
    base = {
        k: log_probs(torch.randn(n, vocab, generator=generator))
        for k, n in zip(keys, lengths, strict=True)
    }
    policy = {
        k: log_probs(v + 0.4 * torch.randn(v.shape, generator=generator)) for k, v in base.items()
    }
    ref = record(base, top_k=vocab)
    pol = record(policy, reference=ref, top_k=vocab)
    qa = [{"doc_id": i, "perplexity": math.log(p), "acc": 1} for i, p in enumerate([0.5, 0.2, 0.4])]
    qa_policy = [{**s, "perplexity": s["perplexity"] - 0.1} for s in qa]
    ppl = [{"doc_id": i, "word_perplexity": (-20.0 - i, 10)} for i in range(2)]
    needle = [{"doc_id": 0, "exact_match": 1.0}, {"doc_id": 1, "exact_match": 1.0}]
    needle_policy = [{"doc_id": 0, "exact_match": 1.0}, {"doc_id": 1, "exact_match": 0.0}]

    def run(qa_samples, needle_samples, recorded):
        tasks = {
            "multikey": task_score(QA, qa_samples),
            "wiki_ppl": task_score(PERPLEXITY, ppl),
            "passkey_greedy": task_score(GENERATION, needle_samples),
        }
        return SuiteRun(tasks, recorded, 1.0)

    folder = TaskFolder(tmp_path, rows, 16)
    suite = EvalSuite(tasks={name: {"docs": 1} for name in rows})
    result = report(
        suite, KVPolicy(), folder, run(qa, needle, ref), run(qa_policy, needle_policy, pol)
    )
    kl = {k: exact_kl(base[k], policy[k]) for k in keys}
    answers = math.exp(-np.mean([float(kl[k].sum()) for k in keys[:3]]))
    tokens = math.exp(-sum(float(kl[k].sum()) for k in keys[3:]) / 11)
    assert result["accuracy_retention"] == pytest.approx((answers + tokens) / 2, rel=1e-4)
    assert result["tasks"]["multikey"]["score_retention"] == pytest.approx(math.exp(-0.1))
    assert result["score_retention"] == pytest.approx((math.exp(-0.1) + 1.0) / 2)
    assert result["generation_exact_match_retention"] == 0.5
    assert result["tasks"]["passkey_greedy"]["retention"] == 0.5
