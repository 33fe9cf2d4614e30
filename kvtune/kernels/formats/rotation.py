"""Rotations of K and V along head_dim, applied before they are quantized.

Keys have a few outlier channels that set a per-token group scale and leave the other channels
two or three codes (DESIGN.md section 2). A randomized Hadamard rotation spreads every channel
over all coordinates, so groups see near-Gaussian values. A rotation is a matrix R with
R R^T = gain * I (gain 1: orthonormal; vLLM's unnormalized transform: gain = its block size):

    (q R / gain) . (k R) = q . k               rotate queries and keys, logits unchanged
    softmax(...) (V R) R^T / gain = softmax(...) V     un-rotate the attention output

Rotations act on row vectors: keys and values are cached as x @ R, queries read them as
q @ R / gain, outputs return as out @ R^T / gain. They are a torch matmul beside the kernels:
the cache stores rotated K and V, and the kernels read codes in place. gain is a power of two,
so dividing by it is exact.

Registry: `ROTATIONS` maps a policy's `rotation` name to a builder (head_dim, layer) ->
KVRotation, the rotation of the layer's keys (queries read them alike) and of its values
(attention outputs are rotated back), each None where that stream is stored as it is.
`kv_rotation` applies it to a layer: none where the layer quantizes no stream, and for the
rotations of QUANTIZED_STREAMS_ONLY (llama.cpp's) only on the streams it quantizes.

hadamard (kvtune's): R = diag(s_l) H / sqrt(D), the random signs of layer l drawn as
`torch.randint(0, 2, (D,))` from `torch.Generator().manual_seed(HADAMARD_SEED + l)` on the CPU,
mapped 0 -> -1, 1 -> +1, so every run, device and process rotates layer l the same way; K, V
and the queries of a layer share R.

turboquant (vLLM 0.33.0's TurboQuant caches): R = H / sqrt(D), the Sylvester Hadamard matrix with
no random signs, the same in every layer, applied to keys only (values are cached as they are,
so the attention output needs no un-rotation).

vllm_rht (vLLM 0.33.0's int4_per_token_head, docs/engine_formats.md): one unnormalized
randomized Hadamard transform for every layer, y = H_b (s * x) in each block of b coordinates
(b the largest power-of-two divisor of head_dim), s = 2 * bernoulli(0.5) - 1 drawn from a CPU
generator seeded VLLM_RHT_SEED; gain b. vLLM casts the rotated K and V back to the model dtype
before quantizing them (round_to_input).

llamacpp (llama.cpp 0c1e570, src/llama-kv-cache.cpp and llama-graph.cpp; docs/engine_formats.md):
a stream is rotated only where its cache type is quantized (attn_rot_k, attn_rot_v) and head_dim
is a multiple of 64 (else nothing is rotated), by the orthonormal Sylvester Walsh-Hadamard matrix
H_b / sqrt(b) of `ggml_gen_hadamard` in each block of b coordinates along head_dim (heads are
never mixed): keys and queries with b the largest power-of-two divisor of head_dim, values and
attention outputs with b = 64; the same matrix in every layer, no signs, gain 1. llama.cpp's CPU
backend computes the products as a fast Walsh-Hadamard transform in fp32 (ggml's fwht: scale
first, then butterflies), and so does kvtune (`ggml_walsh_hadamard`), so a rotated fp32 vector
has llama.cpp's bits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from kvtune.kernels.native.rotate_rows import rotate_rows_native

HADAMARD_SEED = 0
VLLM_RHT_SEED = 0x9E3779B9
# llama.cpp rotates a stream only when head_dim is a multiple of this; its keys in blocks of the
# largest power-of-two divisor of head_dim (at least this), its values in blocks of this.
GGML_ROTATION_UNIT = 64


@dataclass(frozen=True)
class Rotation:
    """One stream's rotation. matrix: fp32 [D, D] with matrix @ matrix.T = gain * I;
    round_to_input: rotated vectors are cast back to the dtype they came in before they are
    quantized; butterflies: 0, or b when the products are llama.cpp's CPU transform of each block
    of b coordinates (`ggml_walsh_hadamard`; matrix is then block-diagonal H_b / sqrt(b),
    symmetric with gain 1, so queries and outputs take the same transform)."""

    matrix: torch.Tensor
    gain: float = 1.0
    round_to_input: bool = False
    butterflies: int = 0

    def to(self, device: torch.device | str) -> Rotation:
        return dataclasses.replace(self, matrix=self.matrix.to(device))

    # The fp64 operands of the three products, built once: a decode step rotates every layer's
    # queries, keys, values and outputs, and rebuilding them took about as long as the products.
    # gain is a power of two, so R / gain is exact and the products keep their bits.
    @cached_property
    def forward64(self) -> torch.Tensor:
        return self.matrix.double()

    @cached_property
    def query64(self) -> torch.Tensor:
        return self.matrix.double() / self.gain

    @cached_property
    def inverse64(self) -> torch.Tensor:
        return (self.matrix.double() / self.gain).T.contiguous()


@dataclass(frozen=True)
class KVRotation:
    """A layer's rotations: keys (queries are rotated alike) and values (attention outputs are
    rotated back); None where the stream is stored as it is."""

    keys: Rotation | None = None
    values: Rotation | None = None

    def to(self, device: torch.device | str) -> KVRotation:
        """On device; a rotation K and V share stays one object (its fp64 operands built once)."""
        keys = None if self.keys is None else self.keys.to(device)
        if self.values is self.keys:
            return KVRotation(keys, keys)
        return KVRotation(keys, None if self.values is None else self.values.to(device))


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


def largest_power_of_two_divisor(n: int) -> int:
    return n & -n


def vllm_rht_matrix(head_dim: int) -> torch.Tensor:
    """vLLM's transform as a row-vector matrix: block-diagonal diag(s) H_b (x @ it = H_b (s*x)
    per block, H_b symmetric), s from torch's CPU Bernoulli sampler as vLLM draws it."""
    block = largest_power_of_two_divisor(head_dim)
    generator = torch.Generator().manual_seed(VLLM_RHT_SEED)
    signs = torch.bernoulli(torch.full((block,), 0.5), generator=generator) * 2 - 1
    return torch.block_diag(*[signs[:, None] * hadamard_matrix(block)] * (head_dim // block))


def _fp32(value: float) -> float:
    """value rounded to fp32 (as a C float stores it)."""
    return torch.tensor(value, dtype=torch.float32).item()


def ggml_hadamard(size: int) -> torch.Tensor:
    """llama.cpp's `ggml_gen_hadamard`: the Sylvester matrix times its entry `1.0 / sqrtf(n)`
    (a float square root, a double division, stored as a float)."""
    return hadamard_matrix(size) * _fp32(1.0 / _fp32(math.sqrt(size)))


def ggml_walsh_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] (D a multiple of block) through ggml's CPU transform (ggml-cpu/ops.cpp,
    ggml_compute_forward_fwht), fp32: each coordinate times the float `1.0f / sqrtf(block)`,
    then butterflies (u + v, u - v) of strides 1, 2, 4, ... within each block. It is
    H_b x / sqrt(b) per block up to fp32 rounding, and has ggml's bits: every step is one
    elementwise fp32 operation, the same on any SIMD width."""
    scale = _fp32(1.0 / _fp32(math.sqrt(block)))  # a float division of two floats: one rounding
    blocks = (x.float() * scale).unflatten(-1, (-1, block))
    stride = 1
    while stride < block:
        first, second = blocks.unflatten(-1, (block // (2 * stride), 2, stride)).unbind(-2)
        blocks = torch.stack((first + second, first - second), dim=-2).flatten(-3)
        stride *= 2
    return blocks.flatten(-2)


def llamacpp_rotation(head_dim: int) -> KVRotation:
    """llama.cpp's rotations of a layer's quantized streams (module docstring): keys in blocks of
    the largest power-of-two divisor of head_dim, values in blocks of 64; none unless head_dim is
    a multiple of 64."""
    if head_dim % GGML_ROTATION_UNIT:
        return KVRotation()

    def blocks_of(size: int) -> Rotation:
        matrix = torch.block_diag(*[ggml_hadamard(size)] * (head_dim // size))
        return Rotation(matrix, butterflies=size)

    return KVRotation(
        blocks_of(largest_power_of_two_divisor(head_dim)), blocks_of(GGML_ROTATION_UNIT)
    )


def _both(rotation: Rotation) -> KVRotation:
    return KVRotation(rotation, rotation)


ROTATIONS: dict[str, Callable[[int, int], KVRotation]] = {
    "none": lambda head_dim, layer: KVRotation(),
    "hadamard": lambda head_dim, layer: _both(Rotation(randomized_hadamard(head_dim, layer))),
    "turboquant": lambda head_dim, layer: KVRotation(
        Rotation(hadamard_matrix(head_dim) / math.sqrt(head_dim))
    ),
    "vllm_rht": lambda head_dim, layer: _both(
        Rotation(vllm_rht_matrix(head_dim), float(largest_power_of_two_divisor(head_dim)), True)
    ),
    "llamacpp": lambda head_dim, layer: llamacpp_rotation(head_dim),
}


# Rotations built from one Sylvester Hadamard matrix of head_dim rows.
POWER_OF_TWO_ROTATIONS = ("hadamard", "turboquant")
# Rotations of only the streams a layer quantizes (the others rotate both streams of a layer
# that quantizes either).
QUANTIZED_STREAMS_ONLY = ("llamacpp",)


def check_rotation(name: str, head_dim: int) -> None:
    """Raise ValueError if rotation `name` cannot rotate vectors of head_dim elements."""
    if name not in ROTATIONS:
        raise ValueError(f"rotation={name!r}: allowed {sorted(ROTATIONS)}")
    if name in POWER_OF_TWO_ROTATIONS and not is_power_of_two(head_dim):
        raise ValueError(f"head_dim={head_dim}: the Hadamard rotation needs a power of two")


def kv_rotation(
    name: str,
    head_dim: int,
    layer: int,
    quantized: tuple[bool, bool] = (True, True),
    device: torch.device | str = "cpu",
) -> KVRotation:
    """The rotation of one layer's K and V on device. quantized: whether the layer quantizes
    its keys and its values; a layer that quantizes neither rotates nothing, and the rotations
    of QUANTIZED_STREAMS_ONLY rotate only the quantized streams."""
    check_rotation(name, head_dim)
    if not any(quantized):
        return KVRotation()
    rotation = ROTATIONS[name](head_dim, layer)
    if name in QUANTIZED_STREAMS_ONLY:
        k_quantized, v_quantized = quantized
        rotation = KVRotation(
            rotation.keys if k_quantized else None, rotation.values if v_quantized else None
        )
    return rotation.to(device)


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Rotated keys or values x [..., D] @ R, fp32 (quantize from full precision; cast back to
    x's dtype first when the rotation says so). Computed in fp64 and rounded once, so a vector
    rotates to the same bits whatever batch it comes in (an fp32 matmul's summation order
    depends on the batch shape, and a flipped code would make a prefill chunk differ from
    decode); llama.cpp's transform as ggml computes it, which is per vector too."""
    if rotation.butterflies:
        return ggml_walsh_hadamard(x, rotation.butterflies)
    rotated = _product(x, rotation.forward64)
    return rotated.to(x.dtype).float() if rotation.round_to_input else rotated


def rotate_queries(q: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Queries q [..., D] @ R / gain, fp32 (via fp64): their dot products with rotated keys
    equal the unrotated ones."""
    if rotation.butterflies:
        return ggml_walsh_hadamard(q, rotation.butterflies)
    return _product(q, rotation.query64)


def unrotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Undo `rotate` on attention outputs: x [..., D] @ R^T / gain, fp32 (via fp64)."""
    if rotation.butterflies:
        return ggml_walsh_hadamard(x, rotation.butterflies)
    return _product(x, rotation.inverse64)


def _product(x: torch.Tensor, matrix64: torch.Tensor) -> torch.Tensor:
    """(x.double() @ matrix64).float(): by the CPU kernel where it applies (one call, the sum
    in a fixed order), else by torch."""
    rotated = rotate_rows_native(x, matrix64)
    return rotated if rotated is not None else (x.double() @ matrix64).float()
