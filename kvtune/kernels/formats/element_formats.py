"""The element formats a KV stream can store, registered once: every list of formats derives
from ELEMENT_FORMATS.

Each format is a small record: its bits, how the Triton helpers decode it (the CODE constexpr of
`kvtune.kernels.formats.quantize`), how its group scale is chosen (symmetric around 0, or
asymmetric with a zero point), torch references that encode / decode its stored bytes, and what
people and the tuner read of it (`FormatInfo`: its table code, its description, the engine
storage it is exported as). The unquantized formats (fp32, fp16, bf16: values stored as they
are) are entries too, so bits, torch dtypes and compute-dtype spellings come from here as well.
`KVFormat` (bytes), `kernels.quantize` (kernels and references), the policy, the planner, the
search space, trial tables and the exporter all read this table: adding a format is one entry
here plus its code functions in their own module (README, "Adding a KV format").

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
L2 norm, and a read rescales the levels to unit norm first: norm correction). llama.cpp's
quantized cache types (`kvtune.kernels.formats.ggml_codes`) are CODE_Q8_0, CODE_IQ4_NL and two
families, CODE_GGML_SIGNED + bits (q4_0, q5_0) and CODE_GGML_MIN + bits (q4_1, q5_1); their
group parameters follow ggml's own arithmetic (`ggml_block`). A format of a new family needs a
CODE of its own and its branches in `kvtune.kernels.formats.quantize`; one of an existing family
(another bit width) needs none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from kvtune.kernels.formats.ggml_codes import (
    decode_iq4_nl_ref,
    decode_q8_0_ref,
    encode_ggml_min_ref,
    encode_ggml_signed_ref,
    encode_iq4_nl_ref,
    encode_q8_0_ref,
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
CODE_Q8_0 = 7
CODE_IQ4_NL = 8
CODE_UINT = 16
CODE_UINT_HALF_UP = 32
CODE_LLOYD = 48
CODE_GGML_SIGNED = 64
CODE_GGML_MIN = 80


@dataclass(frozen=True, kw_only=True)
class FormatInfo:
    """What trial tables, the search and the exporter read of a KV dtype: of every registered
    element format, and of the policy's `auto` alias (`kvtune.runtime.kv_dtypes`).

    table_code: the dtype in a trial's compact per-layer column (trials.csv, MLflow params, plot
        hover text): unique and prefix-free among all KV dtypes, so a layer's K code followed by
        its V code reads back one way.
    description: what is stored, in words, for NOTES.md and messages. Formats of one family
        share it (their names give the bits), so NOTES.md names them in one line.
    nearest_engine: a quantized format's engine storage class: the policy dtype of the least
        precise engine cache that keeps at least its precision, which the exporter's nearest
        config stores where no engine stores the format itself (fp8: E4M3 per tensor in both
        engines; fp4: NVFP4, SGLang's when every layer is FP4). None: unquantized, kept in the
        model dtype.
    ggml_type: llama.cpp's name (ggml_type_name, its --cache-type-k / -v value) for the type
        that stores exactly these elements; None where llama.cpp has no such type.
    """

    table_code: str
    description: str
    nearest_engine: str | None = None
    ggml_type: str | None = None


@dataclass(frozen=True, kw_only=True)
class ElementFormat(FormatInfo):
    """One element code.

    bits: bits a code takes (codes narrower than a byte are packed little end first, in one
        bit stream per vector: `kvtune.kernels.formats.int_codes`).
    code: CODE constexpr the Triton helpers switch on (CODE_FLOAT: unquantized).
    encode: fp32 values in code units [..., D] -> stored bytes [..., D * bits / 8] (torch);
        unquantized: the values cast to torch_dtype.
    decode: stored bytes -> fp32 code values [..., D] (torch).
    max_code: symmetric formats: largest magnitude, scale = amax / max_code; asymmetric ones:
        largest code 2^bits - 1, scale = (max - zero) / max_code.
    zero_point: asymmetric (a zero point is stored beside each group scale).
    alt_max_code: symmetric formats only: a second scale candidate amax / alt_max_code; each
        group keeps the candidate whose reconstruction has the smaller squared error (the first
        on a tie). 0 = one candidate.
    scale_dtype: the one scale dtype the format's scale words need (None: any).
    whole_vector: one group is one whole vector (group_size = head_dim, per token).
    per_element: a stored value is decoded from its own code and its group's scale words alone
        (False: Lloyd-Max's norm correction rescales a group by all its codes), so a code can be
        chosen element by element to round up or down (`kvtune.kernels.formats.directed_rounding`).
    affine_decode: a stored value is code value x group scale (+ zero point), which the fast
        readers (`kvtune.kernels.cache.pool.read_blocks_into`, the native CPU reader) apply
        themselves; False: only `quantize.dequantize` / `dequantize_ref` decode it.
    few_levels: so few magnitudes (E2M1: eight) that the scale must fit the data closely: a
        per-tensor stream gets no calibration headroom, and the planner warns against coarse
        groups.
    torch_dtype: dtype of the stored codes: bytes for a quantized format, the values' own dtype
        for an unquantized one.
    cache_choice: a policy may name it for a K or V stream (fp32 is only what `auto` stores
        for an fp32 model).
    spellings: other names of an unquantized format as a compute dtype (PyTorch's, vLLM's
        --dtype, config.json's torch_dtype).
    """

    bits: int
    code: int
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    max_code: float = 0.0
    zero_point: bool = False
    alt_max_code: float = 0.0
    scale_dtype: str | None = None
    whole_vector: bool = False
    per_element: bool = True
    affine_decode: bool = True
    few_levels: bool = False
    torch_dtype: torch.dtype = torch.uint8
    cache_choice: bool = True
    spellings: tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        """Stored as codes with scales (not the values themselves)."""
        return self.code != CODE_FLOAT

    @property
    def chunk(self) -> int:
        """Codes that fill a whole number of bytes (a vector holds a multiple of them)."""
        return codes_per_chunk(self.bits) if self.quantized else 1

    @property
    def family(self) -> int:
        """CODE of the format's family (CODE_UINT, CODE_UINT_HALF_UP, CODE_LLOYD,
        CODE_GGML_SIGNED, CODE_GGML_MIN) or its own."""
        return self.code if self.code < CODE_UINT else self.code - self.bits

    @property
    def ggml_block(self) -> bool:
        """A llama.cpp quantized type: group parameters by ggml's arithmetic (d, id and an fp32
        minimum subtracted before multiplying, `kvtune.kernels.formats.ggml_codes`)."""
        return self.quantized and self.ggml_type is not None


def _float_format(
    dtype: torch.dtype,
    table_code: str,
    spellings: tuple[str, ...],
    ggml_type: str,
    cache_choice: bool = True,
) -> ElementFormat:
    """An unquantized format: the values themselves, in `dtype`."""
    name = str(dtype).removeprefix("torch.")
    return ElementFormat(
        table_code=table_code,
        description=f"{name} values, stored as they are",
        ggml_type=ggml_type,
        bits=torch.finfo(dtype).bits,
        code=CODE_FLOAT,
        encode=lambda x: x.to(dtype),
        decode=lambda stored: stored.float(),
        torch_dtype=dtype,
        cache_choice=cache_choice,
        spellings=spellings,
    )


def _e2m1_format(
    table_code: str,
    description: str,
    code: int,
    encode_nibbles: Callable[[torch.Tensor], torch.Tensor] = encode_e2m1_fast,
    **fields: Any,
) -> ElementFormat:
    """An FP4 format: E2M1 codes, two a byte (element 2i in the low nibble)."""
    return ElementFormat(
        table_code=table_code,
        description=description,
        bits=4,
        code=code,
        encode=lambda x: pack_e2m1_ref(encode_nibbles(x)),
        decode=decode_packed_e2m1_fast,
        max_code=6.0,
        few_levels=True,
        **fields,
    )


def _uint_format(bits: int, half_up: bool = False) -> ElementFormat:
    """Asymmetric uniform format with `bits`-bit unsigned codes (see
    `kvtune.kernels.formats.int_codes`); half_up: vLLM TurboQuant's value codes (fp32 range,
    halves up, fp16 scale and zero)."""
    encode_units = encode_uint_half_up_ref if half_up else encode_uint_ref
    return ElementFormat(
        table_code=f"t{bits}" if half_up else f"i{bits}",
        description=(
            "vLLM TurboQuant's value codes (asymmetric uniform, coded from the fp32 range with "
            "halves rounded up, an fp16 scale and zero point per group)"
            if half_up
            else "asymmetric uniform integer codes (a scale and a zero point per group)"
        ),
        nearest_engine="fp8",
        bits=bits,
        code=(CODE_UINT_HALF_UP if half_up else CODE_UINT) + bits,
        encode=lambda u: pack_codes_ref(encode_units(u, bits), bits),
        decode=lambda packed: decode_codes_fast(packed, bits),
        max_code=float(2**bits - 1),
        zero_point=True,
        scale_dtype="fp16" if half_up else None,
    )


def _lloyd_format(bits: int) -> ElementFormat:
    """vLLM TurboQuant's key codes: Lloyd-Max levels of the unit vector, its fp16 L2 norm as the
    one group scale. encode takes unit-vector coordinates; decode gives code indices."""
    return ElementFormat(
        table_code=f"l{bits}",
        description=(
            "vLLM TurboQuant's key codes (Lloyd-Max levels of the unit vector and its fp16 norm, "
            "one group a vector)"
        ),
        nearest_engine="fp8",
        bits=bits,
        code=CODE_LLOYD + bits,
        encode=lambda y: pack_codes_ref(encode_lloyd_ref(y, bits, y.shape[-1]), bits),
        decode=lambda packed: decode_codes_fast(packed, bits),
        scale_dtype="fp16",
        whole_vector=True,
        per_element=False,
        affine_decode=False,
    )


def _ggml_format(
    ggml_type: str,
    table_code: str,
    description: str,
    bits: int,
    code: int,
    encode_codes: Callable[[torch.Tensor], torch.Tensor],
    decode: Callable[[torch.Tensor], torch.Tensor],
    max_code: float,
    zero_point: bool = False,
) -> ElementFormat:
    """A llama.cpp quantized cache type (`kvtune.kernels.formats.ggml_codes`): codes of `bits`
    bits packed as kvtune packs them, one fp16 scale (and minimum) per group. encode_codes:
    units -> uint8 codes; decode: stored bytes -> fp32 code values."""
    return ElementFormat(
        table_code=table_code,
        description=description,
        nearest_engine="fp8",
        ggml_type=ggml_type,
        bits=bits,
        code=code,
        encode=lambda units: pack_codes_ref(encode_codes(units), bits),
        decode=decode,
        max_code=max_code,
        zero_point=zero_point,
        scale_dtype="fp16",
    )


def _ggml_signed(bits: int) -> ElementFormat:
    """q4_0 / q5_0: codes offset by 2^(bits - 1), scale max / -2^(bits - 1)."""
    half = 2 ** (bits - 1)
    return _ggml_format(
        f"q{bits}_0",
        f"q{bits}",
        "llama.cpp's signed block codes (q4_0, q5_0: an fp16 scale per group from its element of "
        "largest magnitude)",
        bits,
        CODE_GGML_SIGNED + bits,
        lambda units: encode_ggml_signed_ref(units, bits),
        lambda packed: decode_codes_fast(packed, bits) - half,
        float(half),
    )


def _ggml_min(bits: int) -> ElementFormat:
    """q4_1 / q5_1: unsigned codes, scale (max - min) / (2^bits - 1) and the minimum."""
    return _ggml_format(
        f"q{bits}_1",
        f"u{bits}",
        "llama.cpp's block codes with a minimum (q4_1, q5_1: an fp16 scale and minimum per group)",
        bits,
        CODE_GGML_MIN + bits,
        lambda units: encode_ggml_min_ref(units, bits),
        lambda packed: decode_codes_fast(packed, bits),
        float(2**bits - 1),
        zero_point=True,
    )


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "fp32": _float_format(torch.float32, "f", ("float32", "float"), "f32", cache_choice=False),
    "fp16": _float_format(torch.float16, "h", ("float16", "half"), "f16"),
    "bf16": _float_format(torch.bfloat16, "b", ("bfloat16",), "bf16"),
    "fp8": ElementFormat(
        table_code="8",
        description="FP8 E4M3 codes",
        nearest_engine="fp8",
        bits=8,
        code=CODE_E4M3,
        encode=encode_e4m3_fast,
        decode=decode_e4m3_fast,
        max_code=448.0,
    ),
    "fp4": _e2m1_format("4", "FP4 E2M1 codes", CODE_E2M1, nearest_engine="fp4"),
    "fp4_ties_away": _e2m1_format(
        "m4",
        "FP4 E2M1 codes rounded with halfway values away from zero (SGLang's fp4_mx_block16)",
        CODE_E2M1_TIES_AWAY,
        encode_e2m1_ties_away_ref,
        nearest_engine="fp4",
    ),
    # Each group picks the better of two scales, so NVFP4 would lose precision: FP8 keeps it.
    "fp4_4over6": _e2m1_format(
        "o4",
        "FP4 E2M1 codes, each group scaled by amax / 6 or amax / 4, whichever reconstructs it "
        "better (vLLM's nvfp4_4over6)",
        CODE_E2M1_4OVER6,
        nearest_engine="fp8",
        alt_max_code=4.0,
    ),
    "int8_symmetric": ElementFormat(
        table_code="s8",
        description="symmetric int8 codes (vLLM's int8_per_token_head)",
        nearest_engine="fp8",
        bits=8,
        code=CODE_INT8_SYMMETRIC,
        encode=encode_int8_symmetric_ref,
        decode=decode_int8_symmetric_ref,
        max_code=127.0,
    ),
    "int4_zp_in_scale": ElementFormat(
        table_code="z4",
        description=(
            "int4 codes with an integer zero point in the low bits of each fp32 group scale "
            "(vLLM's int4_per_token_head)"
        ),
        nearest_engine="fp8",
        bits=4,
        code=CODE_INT4_ZERO_IN_SCALE,
        encode=lambda units: pack_codes_ref(encode_zero_in_scale_ref(units), 4),
        decode=lambda packed: decode_codes_fast(packed, 4),
        max_code=15.0,
        scale_dtype="fp32",
        affine_decode=False,
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
    "q8_0": _ggml_format(
        "q8_0",
        "q8",
        "llama.cpp's q8_0 codes (int8, an fp16 scale amax / 127 per group, rounded as its x86 "
        "CPU backend rounds them)",
        8,
        CODE_Q8_0,
        encode_q8_0_ref,
        decode_q8_0_ref,
        127.0,
    ),
    "q4_0": _ggml_signed(4),
    "q5_0": _ggml_signed(5),
    "q4_1": _ggml_min(4),
    "q5_1": _ggml_min(5),
    "iq4_nl": _ggml_format(
        "iq4_nl",
        "n4",
        "llama.cpp's iq4_nl codes (16 non-uniform levels, an fp16 least-squares scale per group)",
        4,
        CODE_IQ4_NL,
        encode_iq4_nl_ref,
        lambda packed: decode_iq4_nl_ref(decode_codes_fast(packed, 4)),
        127.0,
    ),
}
_BY_CODE = {element.code: element for element in ELEMENT_FORMATS.values() if element.quantized}


@triton.constexpr_function
def code_property(code, name):
    """Attribute `name` (bits, max_code, alt_max_code, chunk, family, zero_point) of the element
    format with this CODE, as a Triton constexpr."""
    return getattr(_BY_CODE[code], name)
