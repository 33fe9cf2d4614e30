"""How closely a policy's next-token distributions follow the uncompressed baseline's.

Per scored position the recorder keeps the k most likely tokens and their log-probabilities
(k = 32: a few hundred bytes, where a full SmolLM2 distribution is 196 KB), and, when a
reference is given, the policy's log-probabilities at the reference's top tokens. KL divergence
is then computed over the reference's top k tokens plus one bucket for the rest of the
vocabulary: a lower bound of the full KL(baseline || policy) (merging outcomes never increases
it) that is tight when the baseline's mass sits in its top tokens, as it does at answers.
Summed over each answer's tokens (scored_kl) it is also the suite's headline retention
(scoring.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TOP_K = 32
# Floor for the policy's probability of the reference's "rest" bucket (avoids log 0).
MIN_PROB = 1e-12

Key = tuple[str, ...]


@dataclass(frozen=True)
class ScoredRows:
    """Compact next-token distributions at one request's scored positions.

    top_ids, top_logprobs: [positions, k] the k most likely tokens and their log-probabilities.
    num_tail: leading rows that are prompt positions before the continuation.
    at_reference: [positions, k] log-probabilities at the reference's top_ids (None for the
        reference itself).
    """

    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    num_tail: int
    at_reference: torch.Tensor | None = None

    def to_dict(self) -> dict[str, torch.Tensor | int]:
        """The baseline cache's form (at_reference is per run, never stored there)."""
        return {
            "top_ids": self.top_ids,
            "top_logprobs": self.top_logprobs,
            "num_tail": self.num_tail,
        }


class FidelityRecorder:
    """lm_backend observer: keeps ScoredRows per request key, measured against `reference`.

    Measuring (logits to a record) and keeping are apart because the unit cache stores the
    records: a cached unit's records are kept without the logits that made them.
    """

    def __init__(self, reference: Mapping[Key, ScoredRows] | None = None, top_k: int = TOP_K):
        self.reference = reference or {}
        self.top_k = top_k
        self.rows: dict[Key, ScoredRows] = {}

    def measure(self, key: Key, logprobs: torch.Tensor, num_tail: int) -> dict[str, Any]:
        """The record of one request: ScoredRows' fields, at_reference included."""
        top = logprobs.topk(min(self.top_k, logprobs.shape[-1]), dim=-1)
        reference = self.reference.get(key)
        at_reference = None
        if reference is not None and reference.top_ids.shape[0] == logprobs.shape[0]:
            at_reference = logprobs.gather(1, reference.top_ids.long())
        return {
            "top_ids": top.indices.to(torch.int32),
            "top_logprobs": top.values.float(),
            "num_tail": num_tail,
            "at_reference": at_reference,
        }

    def keep(self, key: Key, record: Mapping[str, Any]) -> None:
        self.rows[key] = ScoredRows(**record)

    def context(self, keys: Sequence[Key]) -> str:
        """Content hash of what decides these requests' records besides their logits: k and
        the reference's top tokens (the ids whose log-probabilities at_reference keeps)."""
        digest = hashlib.sha256(f"top_k={self.top_k}".encode())
        for key in keys:
            reference = self.reference.get(key)
            if reference is None:
                digest.update(b"none;")
                continue
            ids = reference.top_ids.to(torch.int32).contiguous()
            digest.update(f"{tuple(ids.shape)};".encode())
            digest.update(ids.numpy().tobytes())
        return digest.hexdigest()


def coarse_kl(reference: ScoredRows, at_reference: torch.Tensor) -> torch.Tensor:
    """KL(reference || policy) per position over the reference's top k tokens + the rest."""
    p = reference.top_logprobs.exp()
    q = at_reference.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(MIN_PROB)
    top = (p * (reference.top_logprobs - at_reference)).sum(-1)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(MIN_PROB).log() - q_rest.log()), 0)
    return (top + rest).clamp_min(0)


@dataclass
class _Totals:
    kl: list[torch.Tensor]
    tail_kl: list[torch.Tensor]
    top1: list[torch.Tensor]
    answers: list[bool]


def _mean(parts: Sequence[torch.Tensor]) -> float | None:
    values = torch.cat([p.flatten().float() for p in parts]) if parts else torch.empty(0)
    return float(values.mean()) if values.numel() else None


def task_fidelity(
    reference: Mapping[Key, ScoredRows],
    policy: Mapping[Key, ScoredRows],
    keys: Sequence[Key],
    answers: bool,
) -> dict[str, float | None]:
    """Fidelity of one task's requests (keys) to the reference.

    kl: mean KL over scored (continuation) positions; kl_prompt_tail: over the prompt
    positions just before them; top1_agreement: share of scored positions whose most likely
    token matches; answer_agreement: share of requests whose most likely token matches at
    every scored position (with the gold answer fed, the greedy answers agree); only for
    question answering (answers=True), as a perplexity document has no one answer.
    """
    totals = _Totals([], [], [], [])
    for key in keys:
        ref, rows = reference.get(key), policy.get(key)
        if ref is None or rows is None or rows.at_reference is None:
            continue
        kl = coarse_kl(ref, rows.at_reference)
        same = ref.top_ids[:, 0] == rows.top_ids[:, 0]
        tail = ref.num_tail
        totals.kl.append(kl[tail:])
        totals.tail_kl.append(kl[:tail])
        totals.top1.append(same[tail:])
        totals.answers.append(bool(same[tail:].all()))
    return {
        "kl": _mean(totals.kl),
        "kl_prompt_tail": _mean(totals.tail_kl),
        "top1_agreement": _mean(totals.top1),
        "answer_agreement": (
            sum(totals.answers) / len(totals.answers) if answers and totals.answers else None
        ),
    }


def scored_kl(
    reference: Mapping[Key, ScoredRows],
    policy: Mapping[Key, ScoredRows],
    samples: Sequence[Sequence[Key]],
) -> np.ndarray | None:
    """[samples, 2]: per sample (the request keys of one question, or of one document's rolling
    windows), the KL summed over its scored positions and the number of those positions.
    None when a request was not measured against the reference."""
    values = []
    for keys in samples:
        total, positions = 0.0, 0
        for key in keys:
            ref, rows = reference.get(key), policy.get(key)
            if ref is None or rows is None or rows.at_reference is None:
                return None
            kl = coarse_kl(ref, rows.at_reference)[ref.num_tail :]
            total += float(kl.double().sum())
            positions += kl.numel()
        values.append((total, positions))
    return np.asarray(values, dtype=float).reshape(-1, 2)
