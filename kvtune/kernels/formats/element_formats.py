"""The quantized element formats a KV stream can use, registered once.

Each format is a small record: its bits, how the Triton helpers decode it (the CODE constexpr of
`kvtune.kernels.formats.quantize`), how its group scale is chosen (symmetric around 0, or
asymmetric with a zero point) and torch references that encode / decode its stored bytes.
`KVFormat` (bytes), `kernels.quantize` (kernels and references), the policy and the planner all
read this table, so adding a format is one entry here plus its code functions in their own module.

CODE values of the device helpers: CODE_FLOAT (stored as fp32/fp16/bf16), CODE_E4M3, CODE_E2M1,
CODE_E2M1_TIES_AWAY (E2M1 rounded as SGLang's fp4_mx_block16 does: halfway values away from
zero), CODE_E2M1_4OVER6 (E2M1 whose group scale is amax / 6 or amax / 4, whichever reconstructs
the group with the smaller squared error: vLLM's nvfp4_4over6), CODE_INT8_SYMMETRIC (signed
int8 codes with a symmetric scale, vLLM's int8_per_token_head), CODE_INT4_ZERO_IN_SCALE (int4
codes whose integer zero point sits in the low bits of an fp32 scale, vLLM's
int4_per_token_head: `kvtune.kernels.formats.zero_in_scale_codes`), and three families indexed by
bits: CODE_UINT + bits for the unsigned integer codes of the asymmetric formats, CODE_UINT_HALF_UP +
bits for vLLM TurboQuant's value codes (asymmetric, coded from the fp32 range with halves
rounded up, scale and zero point stored in fp16) and CODE_LLOYD + bits for TurboQuant's key
codes (Lloyd-Max levels of the unit vector, `kernels.lloyd_max`; the group "scale" is its fp16
L2 norm, and a read rescales the levels to unit norm first: norm correction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kvtune.kernels.formats.fp_codes import (
    decode_e4m3_fast,
    decode_packed_e2m1_fast,
    encode_e2m1_fast,
    encode_e2m1_ties_away_ref,
    encode_e4m3_fast,
    pack_e2m1_ref,
)
from kvtune.kernels.formats.int_codes import (
    codes_per_chunk,
    decode_codes_fast,
    encode_uint_half_up_ref,
    encode_uint_ref,
    pack_codes_ref,
)
from kvtune.kernels.formats.lloyd_max import encode_lloyd_ref
from kvtune.kernels.formats.symmetric_int_codes import (
    decode_int8_symmetric_ref,
    encode_int8_symmetric_ref,
)
from kvtune.kernels.formats.zero_in_scale_codes import encode_zero_in_scale_ref

CODE_FLOAT = 0
CODE_E4M3 = 1
CODE_E2M1 = 2
CODE_E2M1_TIES_AWAY = 3
CODE_INT8_SYMMETRIC = 4
CODE_E2M1_4OVER6 = 5
CODE_INT4_ZERO_IN_SCALE = 6
CODE_UINT = 16
CODE_UINT_HALF_UP = 32
CODE_LLOYD = 48


@dataclass(frozen=True)
class ElementFormat:
    """One quantized element code.

    bits: bits a code takes (codes narrower than a byte are packed little end first, in one
        bit stream per vector: `kvtune.kernels.formats.int_codes`).
    code: CODE constexpr the Triton helpers switch on.
    max_code: symmetric formats: largest magnitude, scale = amax / max_code; asymmetric ones:
        largest code 2^bits - 1, scale = (max - zero) / max_code.
    zero_point: asymmetric (a zero point is stored beside each group scale).
    encode: fp32 values in code units [..., D] -> stored bytes [..., D * bits / 8] (torch).
    decode: stored bytes -> fp32 code values [..., D] (torch).
    alt_max_code: symmetric formats only: a second scale candidate amax / alt_max_code; each
        group keeps the candidate whose reconstruction has the smaller squared error (the first
        on a tie). 0 = one candidate.
    scale_dtype: the one scale dtype the format's scale words need (None: any).
    whole_vector: one group is one whole vector (group_size = head_dim, per token).
    """

    bits: int
    code: int
    max_code: float
    zero_point: bool
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    alt_max_code: float = 0.0
    scale_dtype: str | None = None
    whole_vector: bool = False

    @property
    def chunk(self) -> int:
        """Codes that fill a whole number of bytes (a vector holds a multiple of them)."""
        return codes_per_chunk(self.bits)

    @property
    def family(self) -> int:
        """CODE of the format's family (CODE_UINT, CODE_UINT_HALF_UP, CODE_LLOYD) or its own."""
        return self.code if self.code < CODE_UINT else self.code - self.bits


def _uint_format(bits: int, half_up: bool = False) -> ElementFormat:
    """Asymmetric uniform format with `bits`-bit unsigned codes (see
    `kvtune.kernels.formats.int_codes`); half_up: vLLM TurboQuant's value codes (fp32 range,
    halves up, fp16 scale and zero)."""
    encode_units = encode_uint_half_up_ref if half_up else encode_uint_ref
    return ElementFormat(
        bits=bits,
        code=(CODE_UINT_HALF_UP if half_up else CODE_UINT) + bits,
        max_code=float(2**bits - 1),
        zero_point=True,
        encode=lambda u: pack_codes_ref(encode_units(u, bits), bits),
        decode=lambda packed: decode_codes_fast(packed, bits),
        scale_dtype="fp16" if half_up else None,
    )


def _lloyd_format(bits: int) -> ElementFormat:
    """vLLM TurboQuant's key codes: Lloyd-Max levels of the unit vector, its fp16 L2 norm as the
    one group scale. encode takes unit-vector coordinates; decode gives code indices."""
    return ElementFormat(
        bits=bits,
        code=CODE_LLOYD + bits,
        max_code=0.0,
        zero_point=False,
        encode=lambda y: pack_codes_ref(encode_lloyd_ref(y, bits, y.shape[-1]), bits),
        decode=lambda packed: decode_codes_fast(packed, bits),
        scale_dtype="fp16",
        whole_vector=True,
    )


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "fp8": ElementFormat(8, CODE_E4M3, 448.0, False, encode_e4m3_fast, decode_e4m3_fast),
    "fp4": ElementFormat(
        4,
        CODE_E2M1,
        6.0,
        False,
        lambda x: pack_e2m1_ref(encode_e2m1_fast(x)),
        decode_packed_e2m1_fast,
    ),
    "fp4_ties_away": ElementFormat(
        4,
        CODE_E2M1_TIES_AWAY,
        6.0,
        False,
        lambda x: pack_e2m1_ref(encode_e2m1_ties_away_ref(x)),
        decode_packed_e2m1_fast,
    ),
    "fp4_4over6": ElementFormat(
        4,
        CODE_E2M1_4OVER6,
        6.0,
        False,
        lambda x: pack_e2m1_ref(encode_e2m1_fast(x)),
        decode_packed_e2m1_fast,
        alt_max_code=4.0,
    ),
    "int8_symmetric": ElementFormat(
        8,
        CODE_INT8_SYMMETRIC,
        127.0,
        False,
        encode_int8_symmetric_ref,
        decode_int8_symmetric_ref,
    ),
    "int4_zp_in_scale": ElementFormat(
        4,
        CODE_INT4_ZERO_IN_SCALE,
        15.0,
        False,
        lambda units: pack_codes_ref(encode_zero_in_scale_ref(units), 4),
        lambda packed: decode_codes_fast(packed, 4),
        scale_dtype="fp32",
    ),
    "int8": _uint_format(8),
    "int4": _uint_format(4),
    "int3": _uint_format(3),
    "int2": _uint_format(2),
    "int4_tq": _uint_format(4, half_up=True),
    "int3_tq": _uint_format(3, half_up=True),
    "lloyd4": _lloyd_format(4),
    "lloyd3": _lloyd_format(3),
    "lloyd2": _lloyd_format(2),
}
_BY_CODE = {element.code: element for element in ELEMENT_FORMATS.values()}


@triton.constexpr_function
def code_property(code, name):
    """Attribute `name` (bits, max_code, alt_max_code, chunk, family, zero_point) of the element
    format with this CODE, as a Triton constexpr."""
    return getattr(_BY_CODE[code], name)
