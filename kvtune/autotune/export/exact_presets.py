"""Which engine preset, if any, stores exactly the cache a policy stores (for llama.cpp, which
sets a type for K and one for V, which preset stores each stream: `exact_llamacpp_types`).

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
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_dtypes import AUTO, EXACT_DTYPES
from kvtune.runtime.policy import KVPolicy

STORAGE_FIELDS = ("group_size", "key_group_size", "scale_dtype", "k_scale_axis", "rotation")
# The fields a stream's storage depends on: keys, values.
STREAM_FIELDS = (
    ("key_group_size", "scale_dtype", "k_scale_axis", "rotation"),
    ("group_size", "scale_dtype", "rotation"),
)
LLAMACPP = "llamacpp"


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


@dataclass(frozen=True)
class LlamaCppTypes:
    """llama.cpp's --cache-type-k and --cache-type-v, and the presets storing K and V as the
    policy does (None for a stream llama.cpp stores as the model's fp32, which has no preset)."""

    cache_type_k: str
    cache_type_v: str
    presets: tuple[str | None, str | None]


def exact_llamacpp_types(policy: KVPolicy, arch: ModelArch) -> LlamaCppTypes | None:
    """The llama.cpp types storing exactly this policy's cache, else None: one K and one V
    dtype for every layer, each a format llama.cpp has (auto: the model's dtype) and, where
    quantized, stored as that type's preset stores it (group, scales, rotation: llama.cpp's,
    which leaves unquantized streams as they are); no compression, no fp16 window."""
    if policy.compressed or policy.recent_unquantized:
        return None
    pairs = set(policy.layer_pairs(arch.num_layers))
    if len(pairs) != 1:
        return None
    [pair] = pairs
    by_dtype = {
        preset.k_dtype: (name, preset)
        for name, preset in engine_presets(arch.cached_vector_size).items()
        if name.startswith(f"{LLAMACPP}/")
    }
    types, presets = [], []
    for dtype, fields in zip(pair, STREAM_FIELDS, strict=True):
        stored = stored_format(dtype, arch)
        element = ELEMENT_FORMATS[stored]
        name, preset = by_dtype.get(stored, (None, None))
        if element.ggml_type is None or (
            element.quantized
            and (preset is None or any(getattr(policy, f) != getattr(preset, f) for f in fields))
        ):
            return None
        types.append(element.ggml_type)
        presets.append(name)
    return LlamaCppTypes(types[0], types[1], (presets[0], presets[1]))


def stored_format(dtype: str, arch: ModelArch) -> str:
    """The registered format a stream of `dtype` stores (auto: the model's dtype)."""
    return arch.dtype if dtype == AUTO else dtype
