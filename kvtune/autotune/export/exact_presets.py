"""Which engine preset, if any, stores exactly the cache a policy stores.

When a policy's quantized layers all use one engine format (same element dtypes, scale groups,
scale dtype and rotation, no per-channel keys, no fp16 window, no compression, and exact
wherever the engine always keeps layers exact: TurboQuant's boundary layers), the export names
that engine's --kv-cache-dtype instead of a nearest config: the engine then serves the codes
kvtune measured. vLLM can keep the policy's exact layers in the model dtype
(kv-cache-dtype-skip-layers); SGLang has one dtype for every layer. The fp32 per-tensor (global)
scale is not compared: engines read it from the checkpoint (1.0 without one), so a calibrated
policy matches the preset's codes up to that one number per layer (NOTES.md says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.autotune.config.engine_presets import engine_presets
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_dtypes import EXACT_DTYPES
from kvtune.runtime.policy import KVPolicy

STORAGE_FIELDS = ("group_size", "key_group_size", "scale_dtype", "k_scale_axis", "rotation")


@dataclass(frozen=True)
class ExactPreset:
    """An engine preset equal to the policy's storage, and the layers the policy keeps exact."""

    name: str  # "<engine>/<dtype>"
    skip_layers: tuple[int, ...]

    @property
    def kv_cache_dtype(self) -> str:
        return self.name.split("/", 1)[1]


def exact_preset(policy: KVPolicy, arch: ModelArch, engine: str) -> ExactPreset | None:
    """The preset of `engine` ("vllm" | "sglang") storing this policy's cache, else None."""
    if policy.compressed or policy.recent_unquantized:
        return None
    pairs = policy.layer_pairs(arch.num_layers)
    skip = tuple(sorted(_exact_layers(pairs)))
    quantized = {pair for i, pair in enumerate(pairs) if i not in skip}
    if len(quantized) != 1 or (skip and engine != "vllm"):
        return None
    for name, preset in engine_presets(arch.cached_vector_size).items():
        if not name.startswith(f"{engine}/"):
            continue
        same = all(getattr(policy, f) == getattr(preset, f) for f in STORAGE_FIELDS)
        # vLLM's TurboQuant keeps its boundary layers exact whatever it is told: so must the
        # policy.
        kept = _exact_layers(preset.layer_pairs(arch.num_layers))
        if same and quantized == {(preset.k_dtype, preset.v_dtype)} and kept <= set(skip):
            return ExactPreset(name, skip)
    return None


def _exact_layers(pairs: list[tuple[str, str]]) -> set[int]:
    return {i for i, pair in enumerate(pairs) if all(d in EXACT_DTYPES for d in pair)}
