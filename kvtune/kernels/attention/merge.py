"""Merge partial attention results by their log-sum-exp.

Attention over a union of key sets (KV splits of one stream, or the sinks / summaries / window
streams of one sequence) equals a weighted sum of each set's partial output, weighted by
exp(lse_part - lse_total). A part that saw no key (lse -inf) gets weight 0; a row whose parts
all saw nothing gets out 0 and lse -inf, never NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    parts_out_ptr,
    parts_lse_ptr,
    out_ptr,
    lse_ptr,
    num_parts,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge BLOCK_R rows (token, head) of parts out [P, rows, D], lse [P, rows] in one pass."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_valid = rows < num_rows
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for part in range(num_parts):
        part_lse = tl.load(parts_lse_ptr + part * num_rows + rows, mask=row_valid, other=0.0)
        part_lse = tl.where(row_valid, part_lse, float("-inf"))
        part_out = tl.load(parts_out_ptr + part * num_rows * HEAD_DIM + offsets, mask=mask)
        m_new = tl.maximum(m, part_lse)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_shift)
        weight = tl.exp(part_lse - m_shift)
        total = total * alpha + weight
        # An empty part (weight 0) adds nothing, whatever its output holds.
        contribution = tl.where(weight[:, None] > 0.0, weight[:, None] * part_out, 0.0)
        acc = acc * alpha[:, None] + contribution
        m = m_new
    has_mass = total > 0.0
    out = acc / tl.where(has_mass, total, 1.0)[:, None]
    lse = tl.where(has_mass, m + tl.log(tl.where(has_mass, total, 1.0)), float("-inf"))
    tl.store(out_ptr + offsets, out, mask=mask)
    tl.store(lse_ptr + rows, lse, mask=row_valid)


def merge_stacked(
    parts_out: torch.Tensor, parts_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge stacked partials out [P, N, H, D], lse [P, N, H] into out [N, H, D], lse [N, H]."""
    num_parts, num_tokens, num_heads, head_dim = parts_out.shape
    expected = (num_parts, num_tokens, num_heads)
    if tuple(parts_lse.shape) != expected:
        raise ValueError(f"parts_lse.shape={tuple(parts_lse.shape)}: must be {expected}")
    parts_out = parts_out.float().contiguous()
    parts_lse = parts_lse.float().contiguous()
    out = parts_out.new_empty(num_tokens, num_heads, head_dim)
    lse = parts_lse.new_empty(num_tokens, num_heads)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, lse
    block_r = 16
    _merge_kernel[(triton.cdiv(num_rows, block_r),)](
        parts_out,
        parts_lse,
        out,
        lse,
        num_parts,
        num_rows,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, lse


def merge_attention(
    partials: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions [(out [N, H, D], lse [N, H]), ...] over disjoint key sets.

    Returns fp32 out [N, H, D] and natural-log lse [N, H] of the union.
    """
    if not partials:
        raise ValueError("partials: must hold at least one (out, lse) pair")
    parts_out = torch.stack([out.float() for out, _ in partials])
    parts_lse = torch.stack([lse.float() for _, lse in partials])
    return merge_stacked(parts_out, parts_lse)


def merge_attention_ref(
    partials: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `merge_attention`."""
    parts_out = torch.stack([out.float() for out, _ in partials])
    parts_lse = torch.stack([lse.float() for _, lse in partials])
    lse = torch.logsumexp(parts_lse, dim=0)
    weights = torch.exp(parts_lse - lse)
    weights = torch.where(lse == float("-inf"), 0.0, weights)[..., None]
    return torch.where(weights > 0, weights * parts_out, 0.0).sum(dim=0), lse
