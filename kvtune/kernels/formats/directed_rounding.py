"""Quantization rounded in a chosen direction: codes whose values, read back, bound their inputs
from above (up) or from below (down), element for element. A bounds index stores each block's
per-channel key maxima rounded up and minima rounded down, so that Quest's
sum_d max(q_d hi_d, q_d lo_d) stays an upper bound of q.k for every key of the block
(`kvtune.kernels.selection.blocks`); rounding to nearest can put a stored maximum below a key.

One rule for every format whose values decode element by element (`ElementFormat.per_element`),
read from the registry, with no branch per format:
- levels: the values in code units that the format's codes decode to (every code, packed as the
  registry packs codes, decoded; NaN codes and codes the encoder never gives back left out);
- group parameters: the format's own rule (`quantize.quantize_groups_ref`), on the group with
  its largest and smallest element widened by a margin, so that the rounding of the stored
  scale or zero point (fp16, E4M3, a clamped integer zero point...) cannot leave the group's
  largest (up) or smallest (down) element beyond every level's value: the margin starts at one
  unit of fp16 rounding of the group's magnitude and doubles where a group is still short;
- codes: per element, the level nearest its value on the chosen side, judged on the values that
  `quantize.dequantize_ref` reads back (the arithmetic every reader of a pool shares), so no
  rounding of a scale, zero point or tensor scale can leave it on the wrong side.
Unquantized formats (fp16, bf16) move a value cast to nearest by one unit in the last place
where it fell on the wrong side.

Limits: a value past what the format can hold clips at its outermost value: past tensor_scale
x its outermost level without group scales (nothing to widen), past the largest scale its scale
dtype stores times that (E4M3 scales stop at 448: the tensor scale's calibration keeps values
within it). Lloyd-Max codes (one norm correction for a whole group) are refused.

Cost: one pass of the format's group rule, one read-back of each group's outermost level and
one of three candidate levels an element (more only where a group or an element needs another
step): 0.5-0.8 ms for one block's bounds (4 KV heads x 64 channels, int4 or fp8) on a CPU core,
3-5x rounding to nearest; an index writes once a block.
"""

from __future__ import annotations

import functools

import torch

from kvtune.kernels.formats.element_formats import ElementFormat
from kvtune.kernels.formats.int_codes import pack_codes_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import (
    dequantize_ref,
    quantize_groups_ref,
    quantize_ref,
    tensor_scale_or_one,
)

ROUND_NEAREST = "nearest"
ROUND_UP = "up"
ROUND_DOWN = "down"
ROUNDINGS = (ROUND_NEAREST, ROUND_UP, ROUND_DOWN)
# Every group's first margin, relative to its magnitude: one unit of fp16 rounding (fp16 keeps
# 11 significant bits), so that an fp16 scale or zero point rounded to nearest reaches it in one
# pass, plus fp16's smallest step (2^-24) for groups of tiny values. It doubles where a group is
# still short, at most this many times (to 2^20 x the group's magnitude: a group still short
# then is past what its scale dtype can hold).
_FIRST_MARGIN = 2.0**-10
_SMALLEST_MARGIN = 2.0**-24
_MAX_WIDENINGS = 30


def rounds_per_element(fmt: KVFormat) -> bool:
    """Whether fmt's codes can be rounded up or down element by element (unquantized formats
    and every registered code with `per_element`)."""
    return not fmt.quantized or fmt.element.per_element


def quantize_rounded_ref(
    x: torch.Tensor,
    fmt: KVFormat,
    tensor_scale: torch.Tensor | None = None,
    rounding: str = ROUND_NEAREST,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`quantize.quantize_ref` of vectors x [..., D] (nearest), or codes and scales whose values
    read back by `dequantize_ref` are >= x (up) or <= x (down) element for element, each the
    nearest such value its group's parameters allow (see the module docstring for how groups
    are widened and what clips)."""
    if rounding == ROUND_NEAREST:
        return quantize_ref(x, fmt, tensor_scale)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: must be one of {', '.join(ROUNDINGS)}")
    upward = rounding == ROUND_UP
    fmt.check_head_dim(x.shape[-1])
    if not fmt.quantized:
        return _float_bound(x.float(), fmt.code_torch_dtype, upward), None
    if not rounds_per_element(fmt) or fmt.token_group > 1:
        raise ValueError(f"rounding={rounding!r}: {fmt} decodes a group at once (nearest only)")
    values = x.float()
    tensor_scale = tensor_scale_or_one(tensor_scale, x.device)
    levels = code_levels(fmt.element).to(x.device)
    units, scales = values / tensor_scale, None
    if fmt.group_size is not None:
        units, scales = _covering_parameters(values, fmt, tensor_scale, levels, upward)
    return _directed_codes(units, scales, values, fmt, tensor_scale, levels, upward), scales


@functools.cache
def code_levels(element: ElementFormat) -> torch.Tensor:
    """fp32 [L] ascending: the values in code units the element format's codes decode to and
    its encoder gives back (NaN codes and codes no value encodes to left out)."""
    every_code = pack_codes_ref(torch.arange(2**element.bits), element.bits)
    decoded = element.decode(every_code).float()
    finite = decoded.isfinite()
    again = element.decode(element.encode(torch.where(finite, decoded, 0.0))).float()
    return decoded[finite & (again == decoded)].unique()


def _float_bound(x: torch.Tensor, dtype: torch.dtype, upward: bool) -> torch.Tensor:
    """x (fp32) cast to dtype, moved one unit in the last place where nearest fell on the wrong
    side (nearest is within one unit of x)."""
    cast = x.to(dtype)
    wrong = cast.float() < x if upward else cast.float() > x
    toward = torch.full_like(cast, torch.inf if upward else -torch.inf)
    return torch.where(wrong, torch.nextafter(cast, toward), cast)


def _covering_parameters(
    values: torch.Tensor,
    fmt: KVFormat,
    tensor_scale: torch.Tensor,
    levels: torch.Tensor,
    upward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in code units [..., D], stored scales) of groups whose outermost level on the
    chosen side reaches every element: the format's own parameters of each group widened by its
    first margin, doubled while it is short."""
    head_dim, size = values.shape[-1], fmt.group_size
    groups = (values / tensor_scale).unflatten(-1, (-1, size))  # [..., G, n]
    top, bottom = groups.amax(dim=-1), groups.amin(dim=-1)
    first = torch.maximum(top.abs(), bottom.abs()) * _FIRST_MARGIN + _SMALLEST_MARGIN
    margin = first
    # Both end levels: a group's scale may be negative (ggml's q4_0 maps its largest magnitude
    # to the level -8), so either end can be the outermost value on the chosen side.
    ends = torch.stack([torch.full_like(values, float(levels[i])) for i in (0, -1)])
    ends = fmt.element.encode(ends)

    def widened(margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(code units, scales, groups still short) of the groups widened by margin."""
        extremes = torch.stack((top + margin, bottom - margin), dim=-1)
        units, scales = quantize_groups_ref(torch.cat((groups, extremes), dim=-1), fmt)
        both = dequantize_ref(ends, scales[None], fmt, tensor_scale, head_dim)
        reach = both.amax(dim=0) if upward else both.amin(dim=0)
        short = (reach < values) if upward else (reach > values)
        return units[..., :size].flatten(-2), scales, short.unflatten(-1, (-1, size)).any(-1)

    for _ in range(_MAX_WIDENINGS):
        units, scales, short = widened(margin)
        if not short.any():
            return units, scales
        margin = torch.where(short, 2 * margin, margin)
    # Groups that no margin serves (past the scale dtype's range): the first margin, clipped.
    units, scales, _ = widened(torch.where(short, first, margin))
    return units, scales


def _directed_codes(
    units: torch.Tensor,
    scales: torch.Tensor | None,
    values: torch.Tensor,
    fmt: KVFormat,
    tensor_scale: torch.Tensor,
    levels: torch.Tensor,
    upward: bool,
) -> torch.Tensor:
    """Codes of the level nearest each value on the chosen side. From the level just inside
    units (units rounded toward the other side), the level before it, it and the one after it
    are read back in one call: an element moves inward while the level inside it is still on
    the chosen side, outward while its own is not; most are done at once (units come within a
    level of the answer: from the stored parameters or, TurboQuant's values, their fp32 forms)."""
    last = len(levels) - 1
    stacked = None if scales is None else scales[None]
    # +1 where a higher level reads back larger (a positive scale), -1 where smaller.
    ends = torch.stack(
        (torch.zeros_like(units, dtype=torch.long), torch.full_like(units, last).long())
    )
    read_ends = dequantize_ref(
        fmt.element.encode(levels[ends]), stacked, fmt, tensor_scale, values.shape[-1]
    )
    ascending = read_ends[1] >= read_ends[0]
    step = torch.where(ascending == upward, 1, -1)
    units = units.contiguous()
    index = torch.where(
        step > 0,
        torch.searchsorted(levels, units, right=True) - 1,
        torch.searchsorted(levels, units),
    ).clamp(0, last)
    while True:
        inner, outer = (index - step).clamp(0, last), (index + step).clamp(0, last)
        candidates = torch.stack((inner, index, outer))
        got = dequantize_ref(
            fmt.element.encode(levels[candidates]), stacked, fmt, tensor_scale, values.shape[-1]
        )
        bounds = got >= values if upward else got <= values
        inward = bounds[0] & (inner != index)
        outward = ~inward & ~bounds[1]
        pending = inward | (outward & ~bounds[2] & (outer != index))
        index = torch.where(inward, inner, torch.where(outward, outer, index))
        if not pending.any():
            return fmt.element.encode(levels[index])
