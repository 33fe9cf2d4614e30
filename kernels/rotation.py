"""Orthonormal rotations of K and V along head_dim, applied before they are quantized.

Keys have a few outlier channels that set a per-token group scale and leave the other channels
two or three codes (DESIGN.md section 2). A randomized Hadamard rotation spreads every channel
over all coordinates, so groups see near-Gaussian values. Because R is orthonormal (R R^T = I):

    (q R) . (k R) = q . k            rotate queries and keys alike, logits unchanged
    softmax(...) (V R) R^T = softmax(...) V     un-rotate the attention output

Rotations act on row vectors: rotated = x @ R, restored = rotated @ R^T. They are a torch matmul
beside the kernels: the cache stores rotated K and V, and the kernels read codes in place.

Registry: `ROTATIONS` maps a policy's `rotation` name to a builder (head_dim, layer) -> R, fp32
[head_dim, head_dim], or None for no rotation.

Seed rule (hadamard): the random signs of layer l are `torch.randint(0, 2, (D,))` drawn from
`torch.Generator().manual_seed(HADAMARD_SEED + l)` on the CPU, mapped 0 -> -1, 1 -> +1, so every
run, device and process rotates layer l the same way; K, V and the queries of a layer share R.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

HADAMARD_SEED = 0


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(size: int) -> torch.Tensor:
    """Sylvester Hadamard matrix, fp32 [size, size] of +-1 (size a power of two).

    Built by doubling: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]].
    """
    if not is_power_of_two(size):
        raise ValueError(f"size={size}: a Sylvester Hadamard matrix needs a power of two")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix


def random_signs(size: int, seed: int) -> torch.Tensor:
    """fp32 [size] of +-1 from a CPU generator seeded with seed (the same on every device)."""
    bits = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed))
    return bits.float() * 2 - 1


def randomized_hadamard(head_dim: int, layer: int) -> torch.Tensor:
    """R = diag(signs of layer) @ H / sqrt(head_dim): flip signs, then mix with Hadamard."""
    signs = random_signs(head_dim, HADAMARD_SEED + layer)
    return signs[:, None] * hadamard_matrix(head_dim) / math.sqrt(head_dim)


ROTATIONS: dict[str, Callable[[int, int], torch.Tensor | None]] = {
    "none": lambda head_dim, layer: None,
    "hadamard": randomized_hadamard,
}


def check_rotation(name: str, head_dim: int) -> None:
    """Raise ValueError if rotation `name` cannot rotate vectors of head_dim elements."""
    if name not in ROTATIONS:
        raise ValueError(f"rotation={name!r}: allowed {sorted(ROTATIONS)}")
    if name == "hadamard" and not is_power_of_two(head_dim):
        raise ValueError(f"head_dim={head_dim}: the Hadamard rotation needs a power of two")


def rotation_matrix(
    name: str, head_dim: int, layer: int, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The fp32 rotation of one layer on device, or None for `none`."""
    check_rotation(name, head_dim)
    matrix = ROTATIONS[name](head_dim, layer)
    return None if matrix is None else matrix.to(device)


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Rotated vectors x [..., D] @ R, fp32 (quantize from full precision). Computed in fp64
    and rounded once, so a vector rotates to the same bits whatever batch it comes in (an fp32
    matmul's summation order depends on the batch shape, and a flipped code would make a
    prefill chunk differ from decode)."""
    return (x.double() @ matrix.double()).float()


def unrotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Undo `rotate`: x [..., D] @ R^T, fp32 (via fp64, as rotate)."""
    return (x.double() @ matrix.double().T).float()
