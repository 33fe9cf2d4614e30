"""A bounds index is a true bound in the formats it is stored in: read back, each block's stored
maximum is >= and its minimum <= every key of the block, element for element, so Quest's score
sum_d max(q_d hi_d, q_d lo_d) is >= q.k for every key and any query.

Formats: every separate index dtype the policy accepts (CSA_INDEX_DTYPES, as the runtime stores
them: `kv_bytes.index_format`), and for an auto index (in the layer's formats) every registered
code that rounds element by element under every scale dtype it takes, with a tensor scale
(calibrated as the runtime does where the format needs one). Data:
random keys, keys with outlier channels and a lone huge key, and adversarial blocks (values a
hair above an fp16 or level boundary, constant channels, one-signed and tiny groups, a group
mixing huge and tiny values). Oracles: the float max and min of the keys (an fp32 pool holds
them exactly), the stored codes read back by `dequantize_ref`, the score and q.k in fp64, and
for a separate index the tightest value on each side that its group's stored scale and zero
point can hold, from each family's levels (ml_dtypes for E4M3 and E2M1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvtune.kernels.cache.pool import KVPool, read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.directed_rounding import rounds_per_element
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.scale_formats import SCALE_FORMATS
from kvtune.kernels.selection.blocks import write_key_bounds
from kvtune.runtime.calibration import tensor_scale
from kvtune.runtime.kv_bytes import index_format
from kvtune.runtime.policy import CSA_INDEX_DTYPES, INDEX_IN_LAYER_FORMAT
from tests.kernels.formats.llamacpp_formats_ref import KVALUES_IQ4NL

BLOCK, KV_HEADS, HEAD_DIM, BLOCKS = 16, 2, 64, 6
# ggml-quants.c dequantize_row_q4_0 / q5_0: (q - 8) x d, (q - 16) x d.
GGML_OFFSET = {"q4_0": 8, "q5_0": 16}
LAYER_TENSOR_SCALE = 0.37  # not a power of two: its multiply rounds


def _separate_formats() -> dict[str, KVFormat]:
    return {
        dtype: index_format(dtype) for dtype in CSA_INDEX_DTYPES if dtype != INDEX_IN_LAYER_FORMAT
    }


def _layer_formats() -> dict[str, KVFormat]:
    """Every per-element quantized code in every scale dtype it accepts, groups of 16."""
    formats = {}
    for name, element in ELEMENT_FORMATS.items():
        if not (element.quantized and element.cache_choice):
            continue
        for scale in SCALE_FORMATS:
            try:
                fmt = KVFormat(name, 16, scale)
            except ValueError:
                continue
            if rounds_per_element(fmt):
                formats[f"{name}_{scale}"] = fmt
    return formats


SEPARATE = _separate_formats()
LAYER = _layer_formats()


def _random(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(BLOCKS * BLOCK, KV_HEADS, HEAD_DIM, generator=generator) * 2


def _outliers(generator: torch.Generator) -> torch.Tensor:
    """RoPE-like outlier channels (x40) and one lone huge key value."""
    keys = _random(generator)
    keys[..., 3::16] *= 40
    keys[5, 1, 40] = 900.0
    keys[37, 0, 7] = -650.0
    return keys


def _adversarial(generator: torch.Generator) -> torch.Tensor:
    """Blocks built to defeat rounding to nearest, channel group by channel group."""
    keys = _random(generator).view(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    fp16_ulp_of_one = 2.0**-10
    # Just above 1 + k ulp of fp16 (nearest rounds down), in every channel of block 0.
    steps = torch.arange(HEAD_DIM, dtype=torch.float32)
    keys[0] = 1 + steps * fp16_ulp_of_one + fp16_ulp_of_one * 0.49
    keys[0, ::2] -= 2 * fp16_ulp_of_one  # the minima just below another boundary
    # Constant channels (a zero span), one value a head.
    keys[1] = torch.tensor([0.3337, -2.71828])[:, None]
    # One-signed groups: all positive in head 0, all negative in head 1.
    keys[2, :, 0] = keys[2, :, 0].abs() + 5
    keys[2, :, 1] = -keys[2, :, 1].abs() - 5
    # Tiny values (fp16 scales underflow) and a group mixing huge and tiny values.
    keys[3] *= 1e-6
    keys[4, :, :, :32] *= 1e-3
    keys[4, 0, :, 0] = 3000.0
    # Values a hair above the E2M1 / uniform levels of a group whose amax is 6.
    levels = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    keys[5] = levels[torch.randint(7, (BLOCK, KV_HEADS, HEAD_DIM), generator=generator)]
    keys[5, 0] = 6.0
    keys[5, 1:] *= 1 + 2.0**-12
    return keys.flatten(0, 1)


DATA = {"random": _random, "outliers": _outliers, "adversarial": _adversarial}


def _stored_bounds(fmt: KVFormat, keys: torch.Tensor, tensor_scale: torch.Tensor | None):
    """The bounds of every block written to shuffled index slots: keys [blocks, BLOCK, H, D]
    as the fp32 pool holds them, (hi [blocks, H, D] read back, its pool), the same for lo,
    and the slots."""
    pool = KVPool.allocate(KVFormat("fp32"), BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    write_vectors_ref(pool, torch.arange(pool.num_slots), keys)
    hi, lo = (KVPool.allocate(fmt, 1, BLOCK, KV_HEADS, HEAD_DIM, tensor_scale) for _ in range(2))
    slots = torch.randperm(BLOCK, generator=torch.Generator().manual_seed(1))[:BLOCKS]
    write_key_bounds(pool, torch.arange(BLOCKS, dtype=torch.int32), hi, lo, slots)
    held = read_vectors_ref(pool, torch.arange(pool.num_slots)).view(BLOCKS, BLOCK, KV_HEADS, -1)
    return held, (read_vectors_ref(hi, slots), hi), (read_vectors_ref(lo, slots), lo), slots


def _check_bounds(held: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """hi >= every key >= lo element for element; the fp64 score >= q.k for random queries."""
    top, bottom = held.amax(dim=1), held.amin(dim=1)
    below = (hi < top).nonzero()
    assert len(below) == 0, f"max above its stored bound at {below[:5].tolist()}"
    above = (lo > bottom).nonzero()
    assert len(above) == 0, f"min below its stored bound at {above[:5].tolist()}"
    queries = torch.randn(32, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    q, keys = queries.double(), held.double()
    terms = torch.maximum(q[:, None] * hi.double()[None], q[:, None] * lo.double()[None])
    dots = torch.einsum("qhd,bthd->qbth", q, keys)  # [queries, blocks, tokens, heads]
    # Products of fp32 values are exact in fp64; the two sums round apart by ~1e-16 of their
    # magnitude, which a tight bound (hi = the key in every channel) may reach.
    slack = 1e-12 * terms.abs().sum(-1)
    assert (dots.amax(dim=2) <= terms.sum(-1) + slack).all()


def _levels(fmt: KVFormat) -> torch.Tensor:
    """The values a code of fmt stands for, from each family's definition: E4M3 and E2M1 from
    ml_dtypes' float8_e4m3fn / float4_e2m1fn, int8_symmetric -128..127, the unsigned integer
    codes 0..2^bits - 1, llama.cpp's from ggml's dequantize_row_* (llamacpp_formats_ref)."""
    if fmt.dtype == "fp8":
        table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif fmt.element.max_code == 6.0 and not fmt.zero_point:  # the E2M1 formats
        table = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    elif fmt.dtype in ("int8_symmetric", "q8_0"):
        table = np.arange(-128, 128, dtype=np.float32)
    elif fmt.dtype in GGML_OFFSET:  # ggml's (q - offset) x d
        table = np.arange(2**fmt.element.bits, dtype=np.float32) - GGML_OFFSET[fmt.dtype]
    elif fmt.dtype == "iq4_nl":  # d x kvalues_iq4nl[q]
        table = KVALUES_IQ4NL.astype(np.float32)
    else:
        assert fmt.zero_point, fmt
        table = np.arange(2**fmt.element.bits, dtype=np.float32)
    table = torch.from_numpy(table)
    return table[table.isfinite()].unique()


def _tightest(fmt: KVFormat, pool: KVPool, slots: torch.Tensor, x: torch.Tensor, up: bool):
    """Per element of x [N, H, D] written at slots: the value nearest it on its side (up: the
    smallest >= x) among those its group's stored fp16 scale (and zero point) can hold:
    level x scale (+ zero), in fp32."""
    if not fmt.quantized:
        dtype = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}[fmt.dtype]
        near = x.numpy().astype(dtype)
        beyond = np.nextafter(near, np.inf if up else -np.inf) if dtype is np.float16 else None
        if beyond is None:  # ml_dtypes has no nextafter: step the bf16 bits
            bits = near.view(np.int16).astype(np.int32)  # sign and magnitude
            outward = (near.astype(np.float32) >= 0) == up  # a larger magnitude
            beyond = (bits + np.where(outward, 1, -1)).astype(np.int16).view(ml_dtypes.bfloat16)
        near, beyond = (torch.from_numpy(v.astype(np.float32)) for v in (near, beyond))
        wrong = near < x if up else near > x
        return torch.where(wrong, beyond, near)
    groups = HEAD_DIM // fmt.group_size
    stored = pool.scales.flatten(0, 1)[slots].float()  # [N, H, G] or [N, H, 2G]
    scale, zero = stored[..., :groups], stored[..., groups:] if fmt.zero_point else 0.0
    values = _levels(fmt) * scale[..., None] + (zero[..., None] if fmt.zero_point else 0.0)
    values = values.repeat_interleave(fmt.group_size, dim=2)  # [N, H, D, levels]
    if up:
        return torch.where(values >= x[..., None], values, torch.inf).amin(-1)
    return torch.where(values <= x[..., None], values, -torch.inf).amax(-1)


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("dtype", SEPARATE)
def test_a_separate_index_bounds_every_key_of_its_block(dtype, data):
    fmt = SEPARATE[dtype]
    held, (hi, hi_pool), (lo, lo_pool), slots = _stored_bounds(
        fmt, DATA[data](torch.Generator().manual_seed(7)), None
    )
    _check_bounds(held, hi, lo)
    # And no looser than the group's stored scale and zero point make them.
    assert torch.equal(hi, _tightest(fmt, hi_pool, slots, held.amax(dim=1), up=True))
    assert torch.equal(lo, _tightest(fmt, lo_pool, slots, held.amin(dim=1), up=False))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("name", LAYER)
def test_an_index_in_a_grouped_layer_format_bounds_every_key(name, data):
    fmt = LAYER[name]
    keys = DATA[data](torch.Generator().manual_seed(8))
    # As the runtime calibrates it where the format needs one (E4M3 scales), else a scale whose
    # multiply rounds.
    scale = tensor_scale(fmt, float(keys.abs().max()))
    scale = torch.tensor([LAYER_TENSOR_SCALE]) if scale is None else scale
    held, (hi, _), (lo, _), _ = _stored_bounds(fmt, keys, scale)
    _check_bounds(held, hi, lo)


def test_the_formats_cover_what_the_policy_accepts():
    """The separate formats are every CSA_INDEX_DTYPES entry but auto, quantized and not."""
    assert set(SEPARATE) == set(CSA_INDEX_DTYPES) - {INDEX_IN_LAYER_FORMAT}
    assert {"fp16", "fp8", "int8", "int4"} <= set(SEPARATE)
    assert any(fmt.zero_point for fmt in LAYER.values())
    assert any(fmt.scale_dtype == "e4m3" for fmt in LAYER.values())
