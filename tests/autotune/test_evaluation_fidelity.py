"""Fidelity metrics: the top-k KL against the exact one, agreement, and the per-task summary."""

from __future__ import annotations

import pytest
import torch

from autotune.evaluation.fidelity import FidelityRecorder, coarse_kl, task_fidelity


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def exact_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def record(logprobs_by_key, reference=None, top_k=8, num_tail=0):
    recorder = FidelityRecorder(reference, top_k=top_k)
    for key, logprobs in logprobs_by_key.items():
        recorder(key, logprobs, num_tail)
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
