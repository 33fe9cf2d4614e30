"""Pools allocated from a KVFormat hold exactly the bytes the arithmetic predicts."""

import pytest

from kvtune.kernels.formats.kv_format import KVFormat


def pool_bytes(codes, scales) -> int:
    total = codes.numel() * codes.element_size()
    return total + (0 if scales is None else scales.numel() * scales.element_size())


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat("fp32"),
        KVFormat("fp16"),
        KVFormat("bf16"),
        KVFormat("fp8"),
        KVFormat("fp8", 32),
        KVFormat("fp8", 64, "e4m3"),
        KVFormat("fp4", 16),
        KVFormat("fp4", 16, "e4m3"),
        KVFormat("fp4", None),
        KVFormat("int8", 64),
        KVFormat("int4", 32),
        KVFormat("int2", 16),
    ],
)
def test_allocated_pool_bytes_equal_vector_bytes(fmt):
    codes, scales = fmt.allocate(num_blocks=5, block_size=16, num_heads=3, head_dim=64)
    assert pool_bytes(codes, scales) == 5 * 16 * 3 * fmt.vector_bytes(64)


def test_unquantized_formats_drop_the_group():
    assert KVFormat("fp16", 32).group_size is None
    assert KVFormat("fp16", 32).vector_bytes(128) == 256


@pytest.mark.parametrize(
    ("fmt", "head_dim", "match"),
    [
        (KVFormat("fp4", 48), 64, "group_size=48"),
        (KVFormat("fp4", 1), 63, "multiple of 2"),
        (KVFormat("int4", 1), 63, "multiple of 2"),
        (KVFormat("int2", 2), 66, "multiple of 4"),
    ],
)
def test_incompatible_head_dim_is_refused(fmt, head_dim, match):
    with pytest.raises(ValueError, match=match):
        fmt.vector_bytes(head_dim)


def test_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="dtype='int5'"):
        KVFormat("int5", 32)
    with pytest.raises(ValueError, match="scale_dtype='fp64'"):
        KVFormat("fp8", 32, "fp64")


@pytest.mark.parametrize(
    ("dtype", "bits"), [("int8", 8), ("int4", 4), ("int2", 2), ("fp8", 8), ("fp4", 4)]
)
@pytest.mark.parametrize("group", [16, 32, 128])
def test_vector_bytes_follow_the_formula(dtype, bits, group):
    """Codes D * bits / 8 bytes, then 2 bytes an fp16 scale per group, and for the asymmetric
    integer formats 2 more bytes a zero point per group."""
    head_dim = 128
    zero_point_bytes = 2 if dtype.startswith("int") else 0
    expected = head_dim * bits // 8 + (head_dim // group) * (2 + zero_point_bytes)
    assert KVFormat(dtype, group).vector_bytes(head_dim) == expected


def test_integer_formats_refuse_per_tensor_and_e4m3_zero_points():
    with pytest.raises(ValueError, match="group_size=None"):
        KVFormat("int4", None)
    with pytest.raises(ValueError, match="scale_dtype='e4m3'"):
        KVFormat("int8", 32, "e4m3")
    with pytest.raises(ValueError, match="group_size=None: fp4_4over6 needs a group size"):
        KVFormat("fp4_4over6", None)
