"""The CPU quantize-on-write kernel (kvtune/kernels/native/write_codes.c) against the torch
reference writer (`write_vectors_ref`: quantize_ref, then the slot writes), bit for bit in
codes and scales: every registered format at per-token groups of 32 and 16 with fp16 scales
(and fp32, E4M3 and UE8M0 scales where the format takes them), and its tensor scale of 0.75 or
none; vectors of mixed magnitudes (groups of zeros, negative
zeros, values past E4M3's and E2M1's largest, groups spanning 1e-3 to 1e3). Formats the kernel
does not serve leave the pool untouched and say so; the torch backend's writer gives the
reference's bits either way."""

import shutil

import pytest
import torch

from kvtune.kernels.cache.pool import KVPool, write_vectors_ref
from kvtune.kernels.cache.write import write_kv_torch
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.native import build
from kvtune.kernels.native.write_codes import SOURCE, write_vectors_native

BLOCKS, BLOCK, HEADS, DIM = 6, 16, 3, 64
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None or not build.native_enabled(SOURCE.stem),
    reason="no C compiler, or native kernels off: the torch path runs instead",
)
# fp16 scales only
ASYMMETRIC = {"int8", "int4", "int3", "int2", "int4_tq", "int3_tq", "q8_0", "q4_0", "q5_0"}
ASYMMETRIC |= {"q4_1", "q5_1"}
SYMMETRIC = {"fp8", "fp4", "fp4_ties_away", "int8_symmetric"}  # fp16 or fp32 scales


def _format(name: str, group: int, scale_dtype: str | None = None) -> KVFormat:
    element = ELEMENT_FORMATS[name]
    scale_dtype = scale_dtype or element.scale_dtype or "fp16"
    return KVFormat(name, DIM if element.whole_vector else group, scale_dtype)


def _served(fmt: KVFormat) -> bool:
    if fmt.scale_dtype == "fp16":
        return fmt.dtype in ASYMMETRIC | SYMMETRIC
    return fmt.scale_dtype == "fp32" and fmt.dtype in SYMMETRIC


def _vectors(n: int, seed: int) -> torch.Tensor:
    """Mixed magnitudes: per (token, head) a scale from 1e-3 to 1e3, some groups all zero,
    some negative zeros, a few values far past the rest."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEADS, DIM, generator=generator)
    x *= 10.0 ** torch.randint(-3, 4, (n, HEADS, 1), generator=generator).float()
    x[0, 0, :32] = 0.0
    x[0, 1, :16] = -0.0
    x[1, 2, 5] *= 1e4
    return x


def _pools(fmt: KVFormat, tensor_scale: float | None) -> tuple[KVPool, KVPool]:
    scale = None if tensor_scale is None else torch.tensor([tensor_scale])
    return tuple(KVPool.allocate(fmt, BLOCKS, BLOCK, HEADS, DIM, scale) for _ in range(2))


SCALED = [
    *[(n, None) for n, e in ELEMENT_FORMATS.items() if e.quantized],
    *[(n, scale) for n in sorted(SYMMETRIC) for scale in ("fp32", "e4m3", "ue8m0")],
]


@needs_compiler
@pytest.mark.parametrize("tensor_scale", [None, 0.75])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("name,scale_dtype", SCALED)
def test_writes_equal_the_reference_bit_for_bit(
    name: str, scale_dtype: str | None, group: int, tensor_scale
) -> None:
    fmt = _format(name, group, scale_dtype)
    native, reference = _pools(fmt, tensor_scale)
    slots = torch.tensor([17, -1, 3, 95, 40, 41, 0])
    vectors = _vectors(len(slots), seed=group)
    before = native.codes.clone()
    served = write_vectors_native(native, slots, vectors)
    assert served == _served(fmt)
    write_vectors_ref(reference, slots, vectors)
    if not served:
        assert torch.equal(native.codes, before)
        return
    assert torch.equal(native.codes, reference.codes)
    assert torch.equal(native.scales.view(torch.uint8), reference.scales.view(torch.uint8))


@pytest.mark.parametrize("name", ["fp8", "int4", "lloyd3", "q4_0"])
def test_the_torch_backends_writer_gives_the_references_bits(name: str) -> None:
    fmt = _format(name, 32)
    k_pool, v_pool = _pools(fmt, 0.75)
    k_ref, v_ref = _pools(fmt, 0.75)
    slots = torch.tensor([2, 30, -1, 64])
    k, v = _vectors(4, seed=1), _vectors(4, seed=2)
    write_kv_torch(k, v, slots, k_pool, v_pool)
    write_vectors_ref(k_ref, slots, k)
    write_vectors_ref(v_ref, slots, v)
    for pool, expected in ((k_pool, k_ref), (v_pool, v_ref)):
        assert torch.equal(pool.codes, expected.codes)
        assert torch.equal(pool.scales.view(torch.int16), expected.scales.view(torch.int16))


@needs_compiler
def test_a_slot_outside_the_pool_raises_and_writes_nothing() -> None:
    pool, _ = _pools(_format("int4", 32), None)
    before = pool.codes.clone()
    with pytest.raises(IndexError, match="slots"):
        write_vectors_native(pool, torch.tensor([3, BLOCKS * BLOCK]), _vectors(2, seed=3))
    assert torch.equal(pool.codes, before)
