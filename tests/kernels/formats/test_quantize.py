"""Group quantization: Triton vs torch reference bit for bit, and both vs torch.float8_e4m3fn /
ml_dtypes.float4_e2m1fn decoding and error bounds."""

from __future__ import annotations

import inspect
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import triton

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import (
    EXACT_ARITHMETIC,
    dequantize,
    dequantize_ref,
    format_switches,
    quantize,
    quantize_ref,
)

REPO_ROOT = Path(__file__).resolve().parents[3]

QUANTIZED_FORMATS = [
    KVFormat(dtype, group, scale)
    for dtype, group, scale in itertools.product(
        ("fp8", "fp4", "fp4_4over6"), (16, 32, 64, 128), ("fp16", "e4m3")
    )
] + [KVFormat("fp8"), KVFormat("fp4")]
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vectors(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0, edge_vectors: bool = True
) -> torch.Tensor:
    """Random K/V-like vectors with outliers; edge_vectors makes vector 0 all zero and vector 1
    tiny (1e-6 scale, where fp16 and E4M3 group scales underflow)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2
    outliers = torch.rand(shape, generator=generator) < 0.02
    x = torch.where(outliers, x * 40, x)
    if edge_vectors:
        flat = x.view(-1, shape[-1])
        flat[0] = 0.0
        flat[1] *= 1e-6
    return x.to(dtype)


def _tensor_scale(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Calibrated fp32 tensor scale: NVFP4-style for e4m3 scales, amax / max_code per tensor."""
    amax = x.float().abs().max()
    if fmt.group_size is None:
        return (amax / fmt.max_code).reshape(1)
    if fmt.scale_dtype == "e4m3":
        return (amax / (448.0 * fmt.max_code)).reshape(1)
    return torch.ones(1)


def _cases(head_dims: tuple[int, ...]) -> list[tuple[KVFormat, int]]:
    return [
        (fmt, head_dim)
        for fmt in QUANTIZED_FORMATS
        for head_dim in head_dims
        if fmt.group_size is None or head_dim % fmt.group_size == 0
    ]


def assert_dequantize_matches_reference(codes, scales, fmt, tensor_scale, head_dim) -> None:
    """Triton dequantize == torch reference, bit for bit, into every output dtype."""
    for out_dtype in INPUT_DTYPES:
        values = dequantize(codes, scales, fmt, tensor_scale, head_dim, out_dtype)
        values_ref = dequantize_ref(codes, scales, fmt, tensor_scale, head_dim, out_dtype)
        assert values.dtype == out_dtype
        assert torch.equal(values.view(torch.uint8), values_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize(("fmt", "head_dim"), _cases((64, 128, 96)), ids=str)
def test_triton_matches_reference_bit_exact(fmt: KVFormat, head_dim: int, dtype) -> None:
    x = _vectors((3, 5, head_dim), dtype)
    tensor_scale = _tensor_scale(x, fmt)
    codes, scales = quantize(x, fmt, tensor_scale)
    codes_ref, scales_ref = quantize_ref(x, fmt, tensor_scale)
    assert codes.shape == (3, 5, fmt.code_bytes(head_dim)) and codes.dtype == torch.uint8
    assert torch.equal(codes, codes_ref)
    if fmt.group_size is None:
        assert scales is None and scales_ref is None
    else:
        assert scales.shape == (3, 5, head_dim // fmt.group_size)
        assert scales.dtype == fmt.scale_torch_dtype
        assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    assert_dequantize_matches_reference(codes, scales, fmt, tensor_scale, head_dim)


def _independent_decode(codes: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Element values of codes through torch.float8_e4m3fn or ml_dtypes.float4_e2m1fn."""
    if fmt.dtype == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    packed = codes.numpy()
    nibbles = np.stack((packed & 0xF, packed >> 4), axis=-1).reshape(*packed.shape[:-1], -1)
    return torch.from_numpy(nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def _independent_scales(scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    if fmt.scale_dtype == "e4m3":
        return scales.view(torch.float8_e4m3fn).float()
    return scales.float()


def _independent_encode(scaled: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Codes of values already in code units, by torch / ml_dtypes casts (saturating)."""
    if fmt.dtype == "fp8":
        return scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    nibbles = scaled.clamp(-6, 6).numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    nibbles = torch.from_numpy(nibbles.copy())
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _independent_group_scales(scaled: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Stored group scales amax / max_code by torch casts; for fp4_4over6 the candidate amax / 4
    replaces it in groups where it reconstructs with a smaller squared error."""
    groups = scaled.unflatten(-1, (-1, fmt.group_size))

    def candidate(max_code: float) -> torch.Tensor:
        exact = groups.abs().amax(-1) / max_code
        if fmt.scale_dtype == "e4m3":
            return exact.to(torch.float8_e4m3fn).view(torch.uint8)
        return exact.half()

    def squared_error(stored: torch.Tensor) -> torch.Tensor:
        scale = _independent_scales(stored, fmt)[..., None]
        units = torch.where(scale == 0, 0.0, groups / torch.where(scale == 0, 1.0, scale))
        codes = _independent_encode(units.flatten(-2), fmt)
        restored = _independent_decode(codes, fmt).unflatten(-1, groups.shape[-2:]) * scale
        return ((restored.double() - groups.double()) ** 2).sum(-1)

    stored = candidate(fmt.max_code)
    if fmt.dtype == "fp4_4over6":
        alternative = candidate(4.0)
        stored = torch.where(
            squared_error(alternative) < squared_error(stored), alternative, stored
        )
    return stored


@pytest.mark.parametrize(("fmt", "head_dim"), _cases((64,)), ids=str)
def test_reference_follows_the_documented_rule(fmt: KVFormat, head_dim: int) -> None:
    """Scales, codes and values re-derived with torch float8 / ml_dtypes casts."""
    x = _vectors((7, head_dim), torch.float32, seed=3)
    tensor_scale = _tensor_scale(x, fmt)
    codes, scales = quantize_ref(x, fmt, tensor_scale)
    scaled = x / tensor_scale
    if fmt.group_size is None:
        scale = torch.ones(7, 1)
    else:
        assert torch.equal(scales, _independent_group_scales(scaled, fmt))
        scale = _independent_scales(scales, fmt).repeat_interleave(fmt.group_size, dim=-1)
    in_code_units = torch.where(scale == 0, 0.0, scaled / torch.where(scale == 0, 1.0, scale))
    assert torch.equal(codes, _independent_encode(in_code_units, fmt))
    values = dequantize_ref(codes, scales, fmt, tensor_scale, head_dim)
    expected_values = _independent_decode(codes, fmt) * scale * tensor_scale
    assert torch.equal(values, expected_values)


def _round_trip_error(fmt: KVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute error of quantize -> dequantize and the amax of each element's group."""
    tensor_scale = _tensor_scale(x, fmt)
    codes, scales = quantize(x, fmt, tensor_scale)
    error = (dequantize(codes, scales, fmt, tensor_scale, x.shape[-1]) - x).abs()
    group = fmt.group_size or x.numel()
    amax = x.reshape(-1, group).abs().amax(-1, keepdim=True).expand(-1, group).reshape(x.shape)
    return error, amax


# Worst case per element, in units of the group amax, while group scales are normal numbers:
# half a code step at the top binade (E4M3 2^-4 relative, E2M1 1 of 6), plus 1/16 headroom
# when an E4M3 scale rounds down.
ERROR_BOUND = {"fp8": 2.0**-4 * 17 / 16, "fp4": (1 / 6) * 17 / 16}


@pytest.mark.parametrize("group_size", [16, 32, 128, None])
@pytest.mark.parametrize("scale_dtype", ["fp16", "e4m3"])
def test_round_trip_error_is_bounded_and_fp8_beats_fp4(group_size, scale_dtype) -> None:
    x = _vectors((16, 128), torch.float32, seed=4, edge_vectors=False)
    errors = {}
    for dtype in ("fp8", "fp4"):
        fmt = KVFormat(dtype, group_size, scale_dtype)
        error, amax = _round_trip_error(fmt, x)
        assert (error <= ERROR_BOUND[dtype] * amax + 1e-30).all(), fmt
        errors[dtype] = error.mean()
    assert 0 < errors["fp8"] < errors["fp4"] / 4


@pytest.mark.parametrize("scale_dtype", ["fp16", "e4m3"])
def test_4over6_reconstructs_no_group_worse_than_fp4_and_most_better(scale_dtype) -> None:
    # Each group keeps amax / 6 or amax / 4, whichever reconstructs it better, so no group can
    # lose against plain fp4 (always amax / 6); measured on the dequantized values.
    x = _vectors((64, 64), torch.float32, seed=7, edge_vectors=False)
    squared_error = {}
    for dtype in ("fp4", "fp4_4over6"):
        fmt = KVFormat(dtype, 16, scale_dtype)
        back = dequantize(*quantize(x, fmt), fmt, None, 64)
        squared_error[dtype] = ((back.double() - x.double()) ** 2).unflatten(-1, (4, 16)).sum(-1)
    assert (squared_error["fp4_4over6"] <= squared_error["fp4"]).all()
    assert (squared_error["fp4_4over6"] < squared_error["fp4"]).float().mean() > 0.25
    assert squared_error["fp4_4over6"].mean() < 0.9 * squared_error["fp4"].mean()


@pytest.mark.parametrize("dtype", ["fp8", "fp4"])
def test_underflowing_fp16_scale_still_bounds_error_by_group_amax(dtype: str) -> None:
    """amax / max_code below fp16's normal range loses scale precision (a documented limit),
    but a value never comes back larger than its group amax nor with the wrong sign."""
    fmt = KVFormat(dtype, 16)
    x = _vectors((4, 64), torch.float32, seed=6, edge_vectors=False) * 1e-6
    codes, scales = quantize(x, fmt)
    assert (scales.float() < 2.0**-14).all()
    values = dequantize(codes, scales, fmt, None, 64)
    error, amax = _round_trip_error(fmt, x)
    assert (error <= amax).all() and (values * x >= 0).all()


def test_zero_group_gives_zero_scale_codes_and_values() -> None:
    fmt = KVFormat("fp4", 16)
    x = torch.zeros(2, 64)
    x[1, 16:32] = 3.0
    codes, scales = quantize(x, fmt)
    assert torch.equal(scales[0], torch.zeros(4, dtype=torch.float16))
    assert scales[1, 1] == 0.5 and scales[1, 0] == 0
    assert torch.equal(dequantize(codes, scales, fmt, None, 64), x)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES)
def test_unquantized_formats_are_a_plain_cast(dtype: str, input_dtype) -> None:
    fmt = KVFormat(dtype)
    x = _vectors((5, 80), input_dtype, seed=5)
    codes, scales = quantize(x, fmt)
    expected = x.to(fmt.code_torch_dtype)
    assert scales is None and codes.dtype == expected.dtype
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(quantize_ref(x, fmt)[0], codes)
    assert torch.equal(dequantize(codes, None, fmt, None, 80), expected.float())


def test_rejects_bad_arguments() -> None:
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="power of two"):
        quantize(x, KVFormat("fp8", 48))
    with pytest.raises(ValueError, match="group_size=64"):
        quantize(x, KVFormat("fp8", 64))
    with pytest.raises(ValueError, match="tensor_scale"):
        quantize(x, KVFormat("fp8"), torch.ones(1, dtype=torch.float64))
    codes, scales = quantize(x, KVFormat("fp8", 32))
    with pytest.raises(ValueError, match="scales"):
        dequantize(codes, None, KVFormat("fp8", 32), None, 96)


def _compile_for_sm90(
    kernel, arg_types: dict[str, str], constexprs: dict[str, object], options: dict | None = None
):
    """Compile one kernel to an sm_90 cubin (no GPU needed); unlisted arguments are int32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {
        name: "constexpr" if name in constexprs else arg_types.get(name, "i32") for name in names
    }
    indexed = {(names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=indexed)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


# PTX that rounds otherwise than the interpreter and the torch references: a contracted
# multiply-add (one rounding for two operations), approximate division, reciprocal, square root.
INEXACT_PTX = re.compile(r"\bfma\.rn\.f32|\bdiv\.(?:full|approx)\.|\b(?:rcp|sqrt)\.approx\.")


def _inexact_instructions(compiled) -> list[str]:
    return sorted({match.group(0) for match in INEXACT_PTX.finditer(compiled.asm["ptx"])})


def _compile_storage_kernel(kernel, arg_types: dict[str, str], constexprs: dict) -> None:
    """Compile a kernel that stores codes as it is launched (EXACT_ARITHMETIC): on the GPU its
    stored bytes must be those of the references, so its PTX rounds every operation alone."""
    compiled = _compile_for_sm90(kernel, arg_types, constexprs, EXACT_ARITHMETIC)
    inexact = _inexact_instructions(compiled)
    assert not inexact, f"{kernel.fn.__name__} with {constexprs}: {inexact}"


SCALE_POINTERS = {"fp16": "*fp16", "e4m3": "*u8", "ue8m0": "*u8", "fp32": "*fp32"}


def compile_kernels_for_cuda() -> None:
    """Compile the quantize, dequantize, cache-write and compress kernels for an H100/H200.

    The interpreter accepts some code the GPU compiler rejects (and the reverse), so this runs
    in a process without TRITON_INTERPRET; see test_kernels_compile_for_cuda.
    """
    from kvtune.kernels.cache import compress
    from kvtune.kernels.cache import write as cache_write
    from kvtune.kernels.formats import quantize as quantize_module

    tile = {"HEAD_DIM": 96, "BLOCK_R": 32, "BLOCK_D": 128}
    for fmt in (
        KVFormat("fp8", 32),
        KVFormat("fp4", 16, "e4m3"),
        KVFormat("fp8"),
        KVFormat("bf16"),
        KVFormat("int8", 32),
        KVFormat("int4", 32),
        KVFormat("int2", 16),
        KVFormat("fp4_4over6", 16, "e4m3"),
        KVFormat("int4_zp_in_scale", 32, "fp32"),
        KVFormat("int3", 32),
        KVFormat("int3_tq", 32),
        KVFormat("lloyd4", 128),
    ):
        pointers = {
            "x_ptr": "*bf16",
            "out_ptr": "*bf16",
            "codes_ptr": "*u8" if fmt.quantized else "*bf16",
            "scales_ptr": SCALE_POINTERS[fmt.scale_dtype],
            "tensor_scale_ptr": "*fp32",
        }
        # Lloyd-Max codes cover one whole vector: a power-of-two head_dim.
        shape = {**tile, "HEAD_DIM": 128} if fmt.dtype.startswith("lloyd") else tile
        for kernel in (quantize_module._quantize_kernel, quantize_module._dequantize_kernel):
            _compile_storage_kernel(kernel, pointers, {**shape, **format_switches(fmt)})
    # The check sees contraction: compiled with the default options, the same code has FMAs.
    zero_in_scale = {**tile, **format_switches(KVFormat("int4_zp_in_scale", 32, "fp32"))}
    pointers = {**pointers, "codes_ptr": "*u8", "scales_ptr": "*fp32"}
    fused = _compile_for_sm90(quantize_module._quantize_kernel, pointers, zero_in_scale)
    assert _inexact_instructions(fused) == ["fma.rn.f32"], _inexact_instructions(fused)
    first, second = KVFormat("fp4", 16, "e4m3"), KVFormat("fp8", 32)
    pool_pointers = {"codes_ptr": "*u8", "tensor_scale_ptr": "*fp32"}
    pointers = {
        "k_ptr": "*fp16",
        "v_ptr": "*fp16",
        "slot_mapping_ptr": "*i64",
        "k_scales_ptr": "*u8",
        "v_scales_ptr": "*fp16",
        **{f"{which}_{name}": kind for which in "kv" for name, kind in pool_pointers.items()},
    }
    switches = {**format_switches(first, "K_"), **format_switches(second, "V_")}
    _compile_storage_kernel(
        cache_write._write_kv_kernel, pointers, {"NUM_HEADS": 8, **tile, **switches}
    )
    pointers = {
        "src_block_ids_ptr": "*i32",
        "dst_slots_ptr": "*i64",
        "align_ptr": "*fp32",
        "src_scales_ptr": "*u8",
        "dst_scales_ptr": "*fp16",
        **{
            f"{which}_{name}": kind
            for which in ("src", "dst")
            for name, kind in pool_pointers.items()
        },
    }
    switches = {**format_switches(first, "SRC_"), **format_switches(second, "DST_")}
    constexprs = {"NUM_HEADS": 8, "BLOCK_SIZE": 16, "RATIO": 4, **tile, **switches}
    _compile_storage_kernel(compress._compress_kernel, pointers, {**constexprs, "ALIGN": False})
    # Keys turned as if before RoPE: the turn is an fp32 tl.dot, FMAs by construction.
    _compile_for_sm90(compress._compress_kernel, pointers, {**constexprs, "ALIGN": True})
    compile_attention_for_cuda()


def compile_attention_for_cuda() -> None:
    """The paged attention kernel (causal and decode, fp4 K / fp8 V; causal int4 K / int2 V) and
    the LSE merge."""
    from kvtune.kernels.attention import merge as attention_merge
    from kvtune.kernels.attention import paged as attention

    pointers = {
        "q_ptr": "*fp16",
        "q_positions_ptr": "*i32",
        "q_seq_starts_ptr": "*i32",
        "k_codes_ptr": "*u8",
        "k_scales_ptr": "*u8",
        "k_tensor_scale_ptr": "*fp32",
        "v_codes_ptr": "*u8",
        "v_scales_ptr": "*fp16",
        "v_tensor_scale_ptr": "*fp32",
        "block_table_ptr": "*i32",
        "lengths_ptr": "*i32",
        "start_positions_ptr": "*i32",
        "query_mask_ptr": "*u8",
        "out_ptr": "*fp32",
        "lse_ptr": "*fp32",
        "scale_log2": "fp32",
        "bias_log2": "fp32",
    }
    switches = {
        **format_switches(KVFormat("fp4", 16, "e4m3"), "K_"),
        **format_switches(KVFormat("fp8", 32), "V_"),
    }
    shape = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16}
    tiles = {"DOT_PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}
    for causal in (True, False):
        for masked in (False, True):  # masked: CSA selection's per-query key mask
            constexprs = {**shape, "CAUSAL": causal, "MASKED": masked, **switches, **tiles}
            _compile_for_sm90(attention._stream_attention_kernel, pointers, constexprs)
    int_switches = {
        **format_switches(KVFormat("int4", 32), "K_"),
        **format_switches(KVFormat("int2", 16), "V_"),
    }
    int_pointers = {**pointers, "k_scales_ptr": "*fp16"}
    constexprs = {**shape, "CAUSAL": True, "MASKED": False, **int_switches, **tiles}
    _compile_for_sm90(attention._stream_attention_kernel, int_pointers, constexprs)
    # vLLM's int4_per_token_head codes: the zero point read out of each fp32 scale word.
    word_switches = {
        **format_switches(KVFormat("int4_zp_in_scale", 128, "fp32"), "K_"),
        **format_switches(KVFormat("int4_zp_in_scale", 128, "fp32"), "V_"),
    }
    word_pointers = {**pointers, "k_scales_ptr": "*fp32", "v_scales_ptr": "*fp32"}
    constexprs = {**shape, "CAUSAL": False, "MASKED": False, **word_switches, **tiles}
    _compile_for_sm90(attention._stream_attention_kernel, word_pointers, constexprs)
    # vLLM TurboQuant's codes: Lloyd-Max keys (fp64 norms) and 3-bit values across bytes.
    turbo_switches = {
        **format_switches(KVFormat("lloyd3", 128), "K_"),
        **format_switches(KVFormat("int3_tq", 128), "V_"),
    }
    turbo_pointers = {**pointers, "k_scales_ptr": "*fp16"}
    constexprs = {**shape, "CAUSAL": False, "MASKED": False, **turbo_switches, **tiles}
    _compile_for_sm90(attention._stream_attention_kernel, turbo_pointers, constexprs)
    merge_pointers = {
        name: "*fp32" for name in ("parts_out_ptr", "parts_lse_ptr", "out_ptr", "lse_ptr")
    }
    merge_constexprs = {"HEAD_DIM": 128, "BLOCK_R": 16, "BLOCK_D": 128}
    _compile_for_sm90(attention_merge._merge_kernel, merge_pointers, merge_constexprs)
    compile_index_scoring_for_cuda()


def compile_index_scoring_for_cuda() -> None:
    """CSA selection's decode scoring kernel: bounds and means, an int4 and an fp16 index."""
    from benchmarks.kernel_registers import compile_index_kernel
    from kvtune.kernels.selection.decode_scores import tile_vectors

    for fmt in (KVFormat("int4", 32, "fp16"), KVFormat("fp16")):
        for bounds in (True, False):
            compile_index_kernel((32, 8, 128), fmt, bounds, tile_vectors(128))


@pytest.mark.slow
def test_kernels_compile_for_cuda() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = "from tests.kernels.formats.test_quantize import compile_kernels_for_cuda as c; c()"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
