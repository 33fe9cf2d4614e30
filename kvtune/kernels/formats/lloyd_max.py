"""Lloyd-Max scalar codes for the coordinates of a rotated unit vector (vLLM TurboQuant's keys):
the codebook, Triton device functions and torch references.

After an orthonormal Hadamard rotation, each coordinate of a unit vector of n elements is close
to Gaussian with variance 1 / n. The codebook minimising the mean squared error of 2^bits levels
for that distribution is found by Lloyd's algorithm, run exactly as vLLM 0.33 runs it at start-up
(`turboquant/centroids.py`), so that the fp32 levels agree bit for bit:

1. sigma = sqrt(1 / n); start from the centres of 2^bits equal cells over [-3.5 sigma, 3.5 sigma];
2. cell edges are the midpoints of neighbouring levels, the outer edges -10.5 sigma and
   +10.5 sigma; each level moves to its cell's conditional mean, both integrals of the Gaussian
   density taken by the trapezoid rule over 200 equal steps per cell;
3. stop when no level moves by 1e-10 (that last move is not applied), or after 200 rounds.

Levels are used in fp32; a value's code is the number of decision boundaries (midpoints of the
fp32 levels, computed in fp32) at or below it, which is the nearest level, ties to the upper one.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

START_SPAN_SIGMAS = 3.5
OUTER_EDGE_SIGMAS = 10.5
TRAPEZOID_STEPS = 200
MAX_ROUNDS = 200
TOLERANCE = 1e-10
# vLLM codes x / (||x|| + NORM_EPS), so an all-zero vector codes without dividing by zero.
NORM_EPS = 1e-8


def _cell_integrals(edges: torch.Tensor, variance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trapezoid-rule mass and first moment of N(0, variance) over each cell between edges."""
    fractions = torch.linspace(0, 1, TRAPEZOID_STEPS + 1, dtype=torch.float64)
    low, high = edges[:-1, None], edges[1:, None]
    x = low + (high - low) * fractions
    density = torch.exp(-x * x / (2 * variance)) / math.sqrt(2 * math.pi * variance)
    weights = torch.ones(TRAPEZOID_STEPS + 1, dtype=torch.float64)
    weights[0] = weights[-1] = 0.5
    step = (high - low)[:, 0] / TRAPEZOID_STEPS
    return (density * weights).sum(-1) * step, (x * density * weights).sum(-1) * step


@cache
def _levels(group: int, bits: int) -> tuple[float, ...]:
    count = 2**bits
    variance = 1.0 / group
    sigma = math.sqrt(variance)
    low, high = -START_SPAN_SIGMAS * sigma, START_SPAN_SIGMAS * sigma
    levels = low + (high - low) * (torch.arange(count, dtype=torch.float64) + 0.5) / count
    outer = torch.tensor([OUTER_EDGE_SIGMAS * sigma], dtype=torch.float64)
    for _ in range(MAX_ROUNDS):
        edges = torch.cat((-outer, (levels[:-1] + levels[1:]) / 2, outer))
        mass, moment = _cell_integrals(edges, variance)
        moved = torch.where(mass > 1e-15, moment / mass.clamp(min=1e-300), levels)
        if (moved - levels).abs().max() < TOLERANCE:
            break
        levels = moved
    return tuple(levels.float().tolist())


def levels(group: int, bits: int) -> torch.Tensor:
    """fp32 [2^bits] ascending levels for unit vectors of `group` elements."""
    return torch.tensor(_levels(group, bits), dtype=torch.float32)


def boundaries(group: int, bits: int) -> torch.Tensor:
    """fp32 [2^bits - 1] decision boundaries: midpoints of neighbouring fp32 levels, in fp32."""
    fp32_levels = levels(group, bits)
    return (fp32_levels[:-1] + fp32_levels[1:]) / 2


@cache
def _boundaries(group: int, bits: int) -> tuple[float, ...]:
    return tuple(boundaries(group, bits).tolist())


# The solvers as Triton constexprs: a constexpr function may call these, not plain functions.
_LEVELS = tl.constexpr(_levels)
_BOUNDARIES = tl.constexpr(_boundaries)


@triton.constexpr_function
def lloyd_level(bits, group, index):
    """Level `index` of the codebook (a Triton constexpr float, exact in fp32)."""
    return _LEVELS(group, bits)[index]


@triton.constexpr_function
def lloyd_boundary(bits, group, index):
    """Decision boundary `index` of the codebook (a Triton constexpr float, exact in fp32)."""
    return _BOUNDARIES(group, bits)[index]


@triton.jit
def encode_lloyd(y, BITS: tl.constexpr, GROUP: tl.constexpr):
    """fp32 tile of unit-vector coordinates -> int32 codes: boundaries at or below each value."""
    codes = tl.zeros(y.shape, tl.int32)
    for index in tl.static_range(2**BITS - 1):
        codes += (y >= lloyd_boundary(BITS, GROUP, index)).to(tl.int32)
    return codes


@triton.jit
def decode_lloyd(codes, BITS: tl.constexpr, GROUP: tl.constexpr):
    """int codes -> fp32 levels."""
    values = tl.zeros(codes.shape, tl.float32)
    for index in tl.static_range(2**BITS):
        values = tl.where(codes == index, lloyd_level(BITS, GROUP, index), values)
    return values


def encode_lloyd_ref(y: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Torch reference of `encode_lloyd`: uint8 codes."""
    edges = boundaries(group, bits).to(y.device)
    return torch.searchsorted(edges, y.float().contiguous(), right=True).to(torch.uint8)


def decode_lloyd_ref(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Torch reference of `decode_lloyd`: fp32 levels."""
    return levels(group, bits).to(codes.device)[codes.long()]
