"""Alignment of post-RoPE keys before they are pooled into one CSA summary.

The model caches keys after RoPE, so key t of a pooled group is turned by its own angle
p_t * w_i in every channel pair i. Averaging those vectors cancels the fast pairs: a pair
turning 1 rad a token keeps about 0.47 of its norm at r = 4 and 0.20 at r = 8. Pooling before
RoPE keeps it: summary = RoPE(c) mean_t RoPE(p_t)^-1 k_t, with c the group's centre. Because
RoPE(c) RoPE(p_t)^-1 = RoPE(c - p_t), that is a fixed turn of each key by its offset from the
centre, (r - 1) / 2 - t for token t of the group, whatever the group's absolute position: the
summary is stored already rotated to its centre, so reading it costs nothing.

RoPE here is the half-split pair layout of the model (runtime/model.py, apply_rope): channel i
pairs with i + D/2 and a turn by angle a maps (x_i, x_{i+D/2}) to
(x_i cos a - x_{i+D/2} sin a, x_{i+D/2} cos a + x_i sin a). Matrices act on row vectors
(x @ M), like kvtune/kernels/formats/rotation.py; a cache rotated by R (x R, R R^T = gain I) is
un-rotated, turned and rotated back: M_t = R^T T_t R / gain.
"""

from __future__ import annotations

import torch

from kvtune.kernels.formats.rotation import Rotation


def rope_turn(inv_freq: torch.Tensor, offset: float) -> torch.Tensor:
    """fp32 [D, D] row-vector matrix turning a post-RoPE vector by `offset` positions."""
    half = inv_freq.shape[0]
    angles = inv_freq.double() * offset
    cos, sin = angles.cos(), angles.sin()
    matrix = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    first, second = torch.arange(half), torch.arange(half) + half
    matrix[first, first] = cos
    matrix[second, second] = cos
    matrix[second, first] = -sin
    matrix[first, second] = sin
    return matrix.float()


def summary_alignment(
    inv_freq: torch.Tensor, ratio: int, rotation: Rotation | None
) -> torch.Tensor:
    """fp32 [ratio, D, D]: the matrix applied to token t of a group before the mean, turning it
    to the group's centre (in the cache's rotated space when `rotation` R is given)."""
    centre = (ratio - 1) / 2
    turns = torch.stack([rope_turn(inv_freq.cpu(), centre - t) for t in range(ratio)])
    if rotation is not None:
        matrix = rotation.matrix.float().cpu()
        turns = matrix.T @ turns @ matrix / rotation.gain
    return turns.to(inv_freq.device).contiguous()
