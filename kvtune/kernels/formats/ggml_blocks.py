"""kvtune's storage of llama.cpp's cache types as ggml's own block bytes, and back.

kvtune keeps a vector's codes packed least significant bits first (element 2i in the low nibble
of byte i; 5-bit codes eight in five bytes) and its fp16 scales d, then minima m, in a scales
buffer beside them (`kvtune.kernels.formats.kv_format`). ggml keeps each block of 32 elements
as one struct (ggml/src/ggml-common.h): ggml_half d, [ggml_half m for the _1 types], [uint8_t
qh[4] for the 5-bit types: bit j of the little-endian word is bit 4 of element j], then qs:
element j in the low nibble and element j + 16 in the high nibble of qs[j] (4- and 5-bit types,
their low four bits), or the 32 int8 codes (q8_0). Both hold the same codes and scales, so the
conversion is exact both ways (tests/kernels/formats/test_llamacpp_formats.py).
"""

from __future__ import annotations

import torch

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS, ElementFormat
from kvtune.kernels.formats.ggml_codes import GGML_BLOCK
from kvtune.kernels.formats.int_codes import pack_codes_ref, unpack_codes_ref

HALF_BYTES = 2
NIBBLE_BITS = 4


def _element(dtype: str) -> ElementFormat:
    element = ELEMENT_FORMATS[dtype]
    if not element.ggml_block:
        ggml = [name for name, e in ELEMENT_FORMATS.items() if e.ggml_block]
        raise ValueError(f"dtype={dtype!r}: allowed {ggml} (llama.cpp's quantized types)")
    return element


def _low_bits(element: ElementFormat) -> int:
    """Bits of a code kept in qs: all 8 for q8_0, else the low nibble."""
    return 8 if element.bits == 8 else NIBBLE_BITS


def block_bytes(dtype: str) -> int:
    """sizeof(block_<dtype>): d, m where the type has a zero point, qh, qs."""
    element = _element(dtype)
    low = _low_bits(element)
    halves = 2 if element.zero_point else 1
    return HALF_BYTES * halves + GGML_BLOCK * (element.bits - low) // 8 + GGML_BLOCK * low // 8


def to_ggml_blocks(codes: torch.Tensor, scales: torch.Tensor, dtype: str) -> torch.Tensor:
    """kvtune's codes [..., D * bits / 8] and fp16 scales [..., D / 32 (* 2)] of a group-32
    stream -> ggml's bytes of the same vectors, uint8 [..., D / 32 * block_bytes(dtype)]."""
    element = _element(dtype)
    values = unpack_codes_ref(codes, element.bits).unflatten(-1, (-1, GGML_BLOCK))
    groups = values.shape[-2]
    fields = [scales[..., :groups].contiguous().view(torch.uint8).unflatten(-1, (groups, 2))]
    if element.zero_point:
        fields.append(scales[..., groups:].contiguous().view(torch.uint8).unflatten(-1, (-1, 2)))
    low = _low_bits(element)
    if element.bits > low:  # qh: one bit a code, little-endian
        high = (values.long() >> low) & 1
        word = (high << torch.arange(GGML_BLOCK)).sum(-1, keepdim=True)
        fields.append(((word >> (8 * torch.arange(GGML_BLOCK // 8))) & 0xFF).to(torch.uint8))
    if low == 8:
        fields.append(values)
    else:
        nibbles = values & 0x0F
        fields.append(nibbles[..., : GGML_BLOCK // 2] | (nibbles[..., GGML_BLOCK // 2 :] << 4))
    return torch.cat(fields, dim=-1).flatten(-2)


def from_ggml_blocks(blocks: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's bytes uint8 [..., blocks * block_bytes(dtype)] -> kvtune's (codes, fp16 scales);
    inverse of `to_ggml_blocks`."""
    element = _element(dtype)
    structs = blocks.unflatten(-1, (-1, block_bytes(dtype)))
    halves = 2 if element.zero_point else 1
    scales = structs[..., : HALF_BYTES * halves].contiguous().view(torch.float16)
    scales = scales.transpose(-1, -2).flatten(-2)  # all d, then all m
    rest = structs[..., HALF_BYTES * halves :]
    low = _low_bits(element)
    high_bytes = GGML_BLOCK * (element.bits - low) // 8
    qs = rest[..., high_bytes:]
    values = qs if low == 8 else torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    if high_bytes:
        word = (rest[..., :high_bytes].long() << (8 * torch.arange(high_bytes))).sum(-1)
        high = (word[..., None] >> torch.arange(GGML_BLOCK)) & 1
        values = values | (high << low).to(torch.uint8)
    return pack_codes_ref(values.flatten(-2), element.bits), scales.contiguous()
