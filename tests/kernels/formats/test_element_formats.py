"""The format registry: every entry's metadata is consistent with its own codes.

Formats are listed from ELEMENT_FORMATS, so a new entry is checked here without an edit.
"""

import pytest
import torch

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS, ElementFormat
from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES, TORCH_DTYPES, KVFormat
from kvtune.kernels.formats.quantize import dequantize, dequantize_ref, quantize, quantize_ref

QUANTIZED = [name for name, element in ELEMENT_FORMATS.items() if element.quantized]
UNQUANTIZED = [name for name, element in ELEMENT_FORMATS.items() if not element.quantized]
HEAD_DIM = 64


def code_units(element: ElementFormat, rows: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 [rows, HEAD_DIM] in the units encode takes: unit vectors for whole-vector codes,
    values within the code range otherwise."""
    x = torch.rand(rows, HEAD_DIM, generator=generator) * 2 - 1
    if element.whole_vector:
        return x / x.norm(dim=-1, keepdim=True)
    return (x + 1) / 2 * element.max_code if element.zero_point else x * element.max_code


def test_table_codes_are_unique_and_prefix_free():
    codes = [element.table_code for element in ELEMENT_FORMATS.values()]
    assert len(set(codes)) == len(codes) and all(codes)
    for a in codes:
        assert not [b for b in codes if b != a and b.startswith(a)], a


def test_quantized_codes_are_distinct_kernel_switches():
    codes = [ELEMENT_FORMATS[name].code for name in QUANTIZED]
    assert len(set(codes)) == len(codes)


@pytest.mark.parametrize("name", QUANTIZED)
def test_bits_are_what_the_codes_take(name):
    """encode packs D codes into D * bits / 8 bytes and decode gives D values back."""
    element = ELEMENT_FORMATS[name]
    units = code_units(element, 8, torch.Generator().manual_seed(0))
    stored = element.encode(units)
    assert stored.dtype == element.torch_dtype == torch.uint8
    assert stored.shape == (8, HEAD_DIM * element.bits // 8)
    assert element.decode(stored).shape == (8, HEAD_DIM)
    assert (
        KVFormat(name, HEAD_DIM, element.scale_dtype or "fp16").code_bytes(HEAD_DIM)
        == (stored.shape[1])
    )


@pytest.mark.parametrize("name", QUANTIZED)
def test_few_levels_marks_the_codes_with_at_most_eight_magnitudes(name):
    """The flag that withholds calibration headroom and warns of coarse groups holds exactly
    for the symmetric codes whose every byte decodes to one of at most eight magnitudes."""
    element = ELEMENT_FORMATS[name]
    if element.whole_vector or element.zero_point:
        assert not element.few_levels  # their codes are indices, not magnitudes
        return
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(element.bits, 1).T.contiguous()
    magnitudes = element.decode(every_byte).abs().unique()
    assert element.few_levels == (len(magnitudes) <= 8), magnitudes


@pytest.mark.parametrize("name", UNQUANTIZED)
def test_unquantized_formats_store_the_values_cast(name):
    element = ELEMENT_FORMATS[name]
    x = torch.randn(4, HEAD_DIM, generator=torch.Generator().manual_seed(1)) * 1e3
    stored = element.encode(x)
    assert stored.dtype == TORCH_DTYPES[name] == element.torch_dtype
    assert element.bits == 8 * torch.tensor([], dtype=stored.dtype).element_size()
    assert torch.equal(element.decode(stored), x.to(stored.dtype).float())
    assert name not in QUANTIZED_DTYPES and element.nearest_engine is None


def test_every_family_shares_its_engine_storage_class():
    """NOTES.md names a family (one description) in one line with one engine storage class."""
    by_description: dict[str, set[str | None]] = {}
    for element in ELEMENT_FORMATS.values():
        by_description.setdefault(element.description, set()).add(element.nearest_engine)
    assert all(len(classes) == 1 for classes in by_description.values()), by_description


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_format_exports_as_a_registered_engine_storage_class(name):
    """The class is itself a format (its own class) with at least as many bits: it keeps the
    format's precision."""
    nearest = ELEMENT_FORMATS[name].nearest_engine
    assert nearest in QUANTIZED_DTYPES and ELEMENT_FORMATS[nearest].nearest_engine == nearest
    assert ELEMENT_FORMATS[nearest].bits >= ELEMENT_FORMATS[name].bits


@pytest.mark.parametrize("name", QUANTIZED)
def test_affine_decode_marks_what_code_times_scale_plus_zero_reconstructs(name):
    """A format read by the fast readers (`affine_decode`) stores codes whose decoded values,
    times the group scale (plus the zero point), are what `dequantize_ref` returns."""
    element = ELEMENT_FORMATS[name]
    group = HEAD_DIM if element.whole_vector else 16
    fmt = KVFormat(name, group, element.scale_dtype or "fp16", tensor_scale="unit")
    x = torch.randn(6, 2, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    codes, scales = quantize_ref(x, fmt, None)
    groups = HEAD_DIM // group
    scale = fmt.scale_format.decode(scales)
    affine = element.decode(codes).unflatten(-1, (groups, -1)) * scale[..., :groups, None]
    if element.zero_point:
        affine = affine + scale[..., groups:, None]
    matches = torch.equal(affine.flatten(-2), dequantize_ref(codes, scales, fmt, None, HEAD_DIM))
    assert matches == element.affine_decode


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_kernels_reach_every_format_and_match_its_references(name):
    """A format's CODE reaches the Triton quantize and dequantize, which equal the torch
    references bit for bit (a format of a new family needs its branches in quantize.py)."""
    element = ELEMENT_FORMATS[name]
    group = HEAD_DIM if element.whole_vector else 16
    fmt = KVFormat(name, group, element.scale_dtype or "fp16")
    x = torch.randn(3, 2, HEAD_DIM, generator=torch.Generator().manual_seed(3)) * 2
    codes, scales = quantize(x, fmt)
    codes_ref, scales_ref = quantize_ref(x, fmt)
    assert torch.equal(codes, codes_ref)
    assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    values = dequantize(codes, scales, fmt, None, HEAD_DIM)
    assert torch.equal(values, dequantize_ref(codes, scales, fmt, None, HEAD_DIM))
