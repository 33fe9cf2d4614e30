"""Pools allocated from a KVFormat hold exactly the bytes the arithmetic predicts."""

import pytest

from kernels.kv_format import KVFormat


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
    [(KVFormat("fp4", 48), 64, "group_size=48"), (KVFormat("fp4", 1), 63, "even")],
)
def test_incompatible_head_dim_is_refused(fmt, head_dim, match):
    with pytest.raises(ValueError, match=match):
        fmt.vector_bytes(head_dim)


def test_unknown_dtypes_are_refused():
    with pytest.raises(ValueError, match="dtype='int4'"):
        KVFormat("int4")
    with pytest.raises(ValueError, match="scale_dtype='fp32'"):
        KVFormat("fp8", 32, "fp32")
