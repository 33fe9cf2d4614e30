"""The CPU kernels (kvtune/kernels/native) against the formats' torch reference readers: a
paged read gives, bit for bit, the vectors `read_vectors_ref` decodes slot by slot, for every
way a format decodes its elements (unsigned nibbles and bytes by arithmetic, fp8, fp4, int2
and signed codes by table) and every scale dtype (fp16, fp32, E4M3 and UE8M0 bytes), into a
slice of a larger buffer; index products equal their definition over those vectors; ids out of
range raise; and the build is cached by content, and skipped without a compiler."""

import ctypes
import math
import shutil

import pytest
import torch

from kvtune.kernels.cache.pool import KVPool, read_blocks_into, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.native import build, pool_codes
from kvtune.kernels.native.read_blocks import SOURCE, index_products_native, read_blocks_native
from kvtune.kernels.native.rotate_rows import rotate_rows_native
from tests.kernels.attention.test_attention import _poisoned_pool

BLOCK, HEADS, DIM = 16, 3, 64
FORMATS = {
    "int4_channel": KVFormat("int4", 1, "fp16", token_group=BLOCK),
    "int4_g64": KVFormat("int4", 64),
    "int4_g32": KVFormat("int4", 32),
    "int8_g64": KVFormat("int8", 64),
    "int2_g2_channel": KVFormat("int2", 2, "fp16", token_group=BLOCK),
    "fp8_g32_ue8m0": KVFormat("fp8", 32, "ue8m0"),
    "fp8_g16": KVFormat("fp8", 16),
    "nvfp4": KVFormat("fp4", 16, "e4m3"),
    "mxfp4_ties_away": KVFormat("fp4_ties_away", 32, "ue8m0"),
    "fp4_g16_token_pairs": KVFormat("fp4", 16, "fp16", token_group=2),
    "int8_symmetric_fp32": KVFormat("int8_symmetric", 64, "fp32"),
    "int3_g32": KVFormat("int3", 32),
    "int3_tq_g32": KVFormat("int3_tq", 32),
    # llama.cpp's types (5-bit codes cross byte boundaries).
    **{f"{name}_g32": KVFormat(name, 32) for name, e in ELEMENT_FORMATS.items() if e.ggml_block},
}
# No compiler here, or the kernels turned off (KVTUNE_NATIVE=0): the tests that need them skip.
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None or not build.native_enabled(SOURCE.stem),
    reason="no C compiler, or native kernels off: the torch paths run instead",
)


def _written_pool(fmt: KVFormat, num_blocks: int, seed: int) -> KVPool:
    """Random vectors (a calibrated tensor scale of 0.75 where the format takes one) in every
    slot of a pool, written by the reference writer."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.75]) if fmt.tensor_scale == "calibrated" else None
    pool = KVPool.allocate(fmt, num_blocks, BLOCK, HEADS, DIM, scale)
    vectors = torch.randn(num_blocks * BLOCK, HEADS, DIM, generator=generator) * 3
    write_vectors_ref(pool, torch.arange(num_blocks * BLOCK), vectors)
    return pool


def _expected(pool: KVPool, table: torch.Tensor) -> torch.Tensor:
    """fp32 [S, H, blocks * BLOCK, D] by the reference reader, slot by slot."""
    slots = (table.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)
    return torch.stack([read_vectors_ref(pool, row).transpose(0, 1) for row in slots])


@needs_compiler
@pytest.mark.parametrize("name", FORMATS)
def test_read_equals_the_reference_reader_into_a_slice(name: str) -> None:
    pool = _written_pool(FORMATS[name], 12, seed=1)
    table = torch.tensor([[7, 2, 11, 0], [5, 9, 3, 1]], dtype=torch.int32)
    buffer = torch.full((2, HEADS, 4 * BLOCK + 10, DIM + 8), math.nan)
    out = buffer[:, :, 5 : 5 + 4 * BLOCK, 8:]  # a slice along tokens and channels
    assert read_blocks_native(pool, table, out)
    assert torch.equal(out, _expected(pool, table))
    untouched = torch.ones_like(buffer, dtype=torch.bool)
    untouched[:, :, 5 : 5 + 4 * BLOCK, 8:] = False
    assert buffer[untouched].isnan().all()


@needs_compiler
def test_read_of_poisoned_slots_reads_only_the_table() -> None:
    """Blocks outside the table hold NaN codes and scales: none of them is read."""
    fmt = FORMATS["int4_channel"]
    pool = _poisoned_pool(fmt, 6, BLOCK, HEADS, DIM)
    written = _written_pool(fmt, 6, seed=2)
    for name in ("codes", "scales"):
        getattr(pool, name)[[1, 4]] = getattr(written, name)[[1, 4]]
    pool.tensor_scale.copy_(written.tensor_scale)
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    out = torch.empty(1, HEADS, 2 * BLOCK, DIM)
    assert read_blocks_native(pool, table, out)
    assert torch.equal(out, _expected(written, table))


@needs_compiler
@pytest.mark.parametrize("kind", ["bounds", "means"])
def test_index_products_equal_their_definition(kind: str) -> None:
    """Bounds: sum over channels of q+ * max + q- * min; means: q . key; for each query head
    (three a KV head) and each index vector up to the longest length (a padded table row)."""
    fmt = FORMATS["int4_g32"]
    high, low = _written_pool(fmt, 8, seed=3), _written_pool(fmt, 8, seed=4)
    table = torch.tensor([[6, 0, 3], [2, 5, -1]], dtype=torch.int32)
    length = 2 * BLOCK + 7
    q = torch.randn(2, HEADS * 3, DIM, generator=torch.Generator().manual_seed(5))
    products = index_products_native(q, high, low if kind == "bounds" else None, table, length)
    assert products is not None and products.shape == (2, HEADS * 3, length)
    tops = _expected(high, table.clamp(min=0)).double()[:, :, :length]
    bottoms = _expected(low, table.clamp(min=0)).double()[:, :, :length]
    queries = q.double().view(2, HEADS, 3, DIM)
    if kind == "bounds":
        expected = torch.einsum("shgd,shtd->shgt", queries.clamp(min=0), tops)
        expected += torch.einsum("shgd,shtd->shgt", queries.clamp(max=0), bottoms)
    else:
        expected = torch.einsum("shgd,shtd->shgt", queries, tops)
    expected = expected.reshape(2, HEADS * 3, length)
    shown = torch.ones(2, length, dtype=torch.bool)
    shown[1, 2 * BLOCK :] = False  # the second sequence's third block is padding: undefined
    assert torch.allclose(
        products.double()[shown[:, None].expand_as(expected)],
        expected[shown[:, None].expand_as(expected)],
        rtol=1e-5,
        atol=1e-4,
    )


@needs_compiler
def test_ids_outside_the_pool_and_wrong_buffers_raise() -> None:
    pool = _written_pool(FORMATS["int4_g64"], 4, seed=6)
    out = torch.empty(1, HEADS, BLOCK, DIM)
    with pytest.raises(IndexError, match="table"):
        read_blocks_native(pool, torch.tensor([[4]], dtype=torch.int32), out)
    with pytest.raises(ValueError, match="out: shape"):
        read_blocks_native(pool, torch.tensor([[0, 1]], dtype=torch.int32), out)


def test_disabled_kernels_leave_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ENABLE_VARIABLE, "0")
    pool = _written_pool(FORMATS["int4_channel"], 4, seed=7)
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    out = torch.full((1, HEADS, 2 * BLOCK, DIM), math.nan)
    assert not read_blocks_native(pool, table, out)
    assert out.isnan().all()
    read_blocks_into(pool, table, out)  # the torch path
    assert torch.equal(out, _expected(pool, table))


@pytest.fixture
def fresh_builds(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """An empty kvtune cache and no library loaded yet (loaded ones are forgotten after)."""
    monkeypatch.setenv("KVTUNE_CACHE", str(tmp_path))
    build._load.cache_clear()
    build._compiler.cache_clear()
    yield tmp_path / "native"
    build._load.cache_clear()
    build._compiler.cache_clear()


@needs_compiler
def test_builds_are_cached_by_source_and_header_content(fresh_builds, tmp_path) -> None:
    source, header = tmp_path / "read_blocks.c", tmp_path / "pool_codes.h"
    source.write_bytes(SOURCE.read_bytes())
    header.write_bytes((SOURCE.parent / "pool_codes.h").read_bytes())
    assert build.load_kernel(source) is not None
    first = sorted(fresh_builds.glob("*.so"))
    build._load.cache_clear()
    build.load_kernel(source)  # the same content: the same library, not rebuilt
    assert sorted(fresh_builds.glob("*.so")) == first and len(first) == 1
    for changed in (source, header):  # a changed source or included header: a new library
        changed.write_text(changed.read_text() + "\n/* changed */\n")
        build._load.cache_clear()
        assert build.load_kernel(source) is not None
    assert len(list(fresh_builds.glob("*.so"))) == 3


def test_without_a_compiler_the_torch_path_runs(
    fresh_builds, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv(build.ENABLE_VARIABLE, raising=False)  # the compiler is what is missing
    assert build.load_kernel(SOURCE) is None
    assert "no C compiler" in caplog.text
    pool = _written_pool(FORMATS["nvfp4"], 4, seed=8)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    out = torch.empty(1, HEADS, 2 * BLOCK, DIM)
    read_blocks_into(pool, table, out)
    assert torch.equal(out, _expected(pool, table))


@needs_compiler
@pytest.mark.parametrize("dim", [64, 96, 128])
def test_rotation_products_round_the_fp64_product_once_whatever_the_batch(dim: int) -> None:
    """Within an fp32 ulp of the fp64 product, and each row rotates to the same bits alone
    as in a batch of 37 (prefill) or in fp16 input."""
    generator = torch.Generator().manual_seed(9)
    matrix = torch.randn(dim, dim, dtype=torch.float64, generator=generator)
    x = torch.randn(37, 3, dim, generator=generator)
    rotated = rotate_rows_native(x, matrix)
    assert rotated is not None and rotated.dtype == torch.float32 and rotated.shape == x.shape
    exact = x.double() @ matrix
    assert ((rotated.double() - exact).abs() <= exact.abs() * 2**-23 + 1e-30).all()
    for row in (0, 17, 36):
        assert torch.equal(rotate_rows_native(x[row : row + 1], matrix), rotated[row : row + 1])
    halves = x.half()
    assert torch.equal(
        rotate_rows_native(halves, matrix), rotate_rows_native(halves.float(), matrix)
    )


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_decodes_to_torchs_float(dtype: torch.dtype) -> None:
    """pool_codes.h's decode of unquantized fp16 and bf16 values (its own bit arithmetic):
    every one of the 65536 bit patterns gives torch's fp32 conversion, NaN for NaN."""
    library = build.load_kernel(pool_codes.SOURCE)
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    probe = pool_codes.PoolCodes(head_dim=len(values), decode=pool_codes.UNQUANTIZED_DECODES[dtype])
    decoded = torch.empty(len(values))
    library.kvtune_decode_elements(
        ctypes.byref(probe), ctypes.c_void_p(values.data_ptr()), ctypes.c_void_p(decoded.data_ptr())
    )
    expected = values.float()
    assert torch.equal(decoded.isnan(), expected.isnan())
    shown = ~expected.isnan()
    assert torch.equal(decoded[shown].view(torch.int32), expected[shown].view(torch.int32))
