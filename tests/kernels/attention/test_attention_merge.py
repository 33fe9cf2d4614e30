"""LSE merge of partial attentions: Triton kernel vs torch reference vs one full softmax."""

from __future__ import annotations

import math

import pytest
import torch

from kvtune.kernels.attention.merge import merge_attention, merge_attention_ref

TOLERANCE = 1e-5


def _partial(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of logits [N, H, K] over values [K, D]: out [N, H, D], lse [N, H]."""
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.where(lse[..., None] == -math.inf, 0.0, torch.exp(logits - lse[..., None]))
    return weights @ values, lse


@pytest.mark.parametrize("num_parts,head_dim", [(1, 64), (2, 128), (5, 80)])
def test_merge_equals_one_softmax_over_all_keys(num_parts, head_dim):
    """Merging the partials of disjoint key sets == one softmax over their union."""
    generator = torch.Generator().manual_seed(num_parts)
    logits = torch.randn(7, 3, 40, generator=generator) * 4
    logits[0, :, :] = -math.inf  # a query that sees no key at all
    logits[1, :, :20] = -math.inf  # one that sees only some parts
    values = torch.randn(40, head_dim, generator=generator)
    bounds = torch.linspace(0, 40, num_parts + 1).long().tolist()
    partials = [
        _partial(logits[..., begin:end], values[begin:end])
        for begin, end in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    expected_out, expected_lse = _partial(logits, values)
    for out, lse in (merge_attention(partials), merge_attention_ref(partials)):
        assert not out.isnan().any() and not lse.isnan().any()
        error = (out - expected_out).norm() / expected_out.norm()
        assert error <= TOLERANCE
        assert torch.equal(lse == -math.inf, expected_lse == -math.inf)
        finite = expected_lse > -math.inf
        assert torch.allclose(lse[finite], expected_lse[finite], rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.all(merge_attention(partials)[0][0] == 0)


def test_merge_ignores_the_output_of_empty_parts():
    """A part with lse -inf contributes nothing, even if its output holds garbage."""
    generator = torch.Generator().manual_seed(9)
    full = (torch.randn(4, 2, 64, generator=generator), torch.randn(4, 2, generator=generator))
    empty = (torch.full((4, 2, 64), math.nan), torch.full((4, 2), -math.inf))
    for merge in (merge_attention, merge_attention_ref):
        out, lse = merge([empty, full, empty])
        assert torch.allclose(out, full[0], rtol=TOLERANCE, atol=TOLERANCE)
        assert torch.allclose(lse, full[1], rtol=TOLERANCE, atol=TOLERANCE)


def test_merge_rejects_no_partials():
    with pytest.raises(ValueError, match="partials"):
        merge_attention([])
