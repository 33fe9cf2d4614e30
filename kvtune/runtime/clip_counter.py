"""Counts the K and V values a cache writes beyond its formats' range (they saturate).

A stream scaled per tensor (fp8 per tensor, vLLM's fp8) or by E4M3 group scales (NVFP4) has a
largest representable magnitude fixed before the first write: max_code x tensor scale, times
448 for E4M3 group scales. Values beyond it are clipped to it. Calibration (runtime/calibration)
sets the tensor scale from a fixed text; this counter says how often the workload's own values
exceed it, so a bad calibration, or an engine's unit scale, shows up as a number instead of a
silent accuracy loss. Streams with fp16, fp32 or UE8M0 group scales adapt to every group and
are not counted. Every row of a step's K and V gets a slot, so every row is counted. Counts
stay on the device (no synchronization per layer).
"""

from __future__ import annotations

import torch

from kvtune.kernels.formats.kv_format import KVFormat


def range_limit(fmt: KVFormat, tensor_scale: torch.Tensor | None) -> float | None:
    """Largest magnitude a stream of fmt stores unclipped (tensor scale None: 1), or None when
    its groups adapt to every value."""
    scale = 1.0 if tensor_scale is None else float(tensor_scale)
    if not fmt.quantized:
        return None
    if fmt.group_size is None:
        return fmt.max_code * scale
    if fmt.scale_format.relative_max is not None:
        return fmt.max_code * fmt.scale_format.relative_max * scale
    return None


class ClipCounter:
    """Per cache: values written and values beyond their stream's range_limit, K and V alike."""

    def __init__(self, limits: list[tuple[float | None, float | None]], device: torch.device):
        self.limits = limits
        self._clipped = torch.zeros((), dtype=torch.int64, device=device)
        self._checked = torch.zeros((), dtype=torch.int64, device=device)

    def count(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Count this step's k, v [tokens, heads, D] of one layer."""
        for x, limit in zip((k, v), self.limits[layer], strict=True):
            if limit is not None:
                self._clipped += (x.abs() > limit).sum()
                self._checked += x.numel()

    @property
    def clipped(self) -> int:
        return int(self._clipped)

    @property
    def checked(self) -> int:
        return int(self._checked)
