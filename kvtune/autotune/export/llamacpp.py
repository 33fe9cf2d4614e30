"""llama-server's flags for a trial (llama-server.args) and what llama.cpp cannot express of it.

llama.cpp (the version docs/engine_formats.md pins: 0c1e570, vendored by llama-cpp-python
0.3.36) keeps one cache type for the keys and one for the values of every layer
(`--cache-type-k`, `--cache-type-v`; the types are the registry's `ggml_type` names), rotates
the quantized streams by its Walsh-Hadamard blocks (policy rotation: llamacpp), keeps every
token, and refuses a quantized V without flash attention (`--flash-attn on`). When the policy
stores exactly what two types store (`exact_presets.exact_llamacpp_types`) the export names
them; otherwise, per stream, the type of the most precise format any layer needs, each format
mapped to itself where llama.cpp has it (auto: the model's dtype) and else to the llama.cpp
type of the fewest bits that keeps its bits, asymmetric where it is (int4 -> q4_1, fp8 -> q8_0).

Sizing: `--parallel` slots of the workload's context rounded up to llama.cpp's 256 (it pads a
slot's context to a multiple of 256), as many as the planner fits on the target device at that
context, at most LLAMA_MAX_SEQ (256); `--ctx-size` is the total over all slots (llama.cpp splits
it evenly between them).
"""

from __future__ import annotations

import math

from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.autotune.export.exact_presets import (
    LLAMACPP,
    LlamaCppTypes,
    exact_llamacpp_types,
    stored_format,
)
from kvtune.autotune.planning.capacity import capacity_row, kv_budget_bytes
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.ggml_codes import GGML_BLOCK
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_dtypes import AUTO, KV_DTYPE_INFO, most_precise_first
from kvtune.runtime.policy import NO_ROTATION, KVPolicy

# llama.cpp pads the context (of the whole cache, and of each slot) up to a multiple of this.
CONTEXT_PAD = 256
# src/llama-cparams.h's LLAMA_MAX_SEQ: the most slots (sequences) a context takes.
MAX_SLOTS = 256
# The formats llama.cpp stores, by the registry's ggml types.
LLAMACPP_FORMATS = tuple(name for name, e in ELEMENT_FORMATS.items() if e.ggml_block)


def cache_type(dtype: str, arch: ModelArch) -> str:
    """llama.cpp's name of the type storing a stream of `dtype` (auto: the model's dtype)."""
    ggml_type = ELEMENT_FORMATS[stored_format(dtype, arch)].ggml_type
    if ggml_type is None:
        raise ValueError(f"dtype={dtype!r}: llama.cpp has no such cache type")
    return ggml_type


def stream_types(policy: KVPolicy, arch: ModelArch) -> tuple[str, str]:
    """(--cache-type-k, --cache-type-v) of a policy that llama.cpp stores (one pair of dtypes
    for every layer, each a llama.cpp type)."""
    [(k_dtype, v_dtype)] = set(policy.layer_pairs(arch.num_layers))
    return cache_type(k_dtype, arch), cache_type(v_dtype, arch)


def nearest_llamacpp_dtype(dtype: str) -> str:
    """The policy dtype llama.cpp would store for a stream of `dtype`: the dtype itself where
    llama.cpp has its type (auto too), else the llama.cpp format of the fewest bits at least
    dtype's, with a zero point where dtype has one when such a type exists (registry order on
    ties)."""
    if dtype == AUTO or ELEMENT_FORMATS[dtype].ggml_type is not None:
        return dtype
    element = ELEMENT_FORMATS[dtype]
    wide = [n for n in LLAMACPP_FORMATS if ELEMENT_FORMATS[n].bits >= element.bits]
    alike = [n for n in wide if ELEMENT_FORMATS[n].zero_point == element.zero_point] or wide
    return min(alike, key=lambda n: ELEMENT_FORMATS[n].bits)


def llamacpp_policy(policy: KVPolicy, arch: ModelArch) -> tuple[KVPolicy, LlamaCppTypes | None]:
    """(the policy llama.cpp's export stores, and the types when that is this policy's own
    cache; None for a nearest config, a different cache). Nearest: per stream, the most
    precise of the layers' nearest llama.cpp dtypes, stored as llama.cpp stores them."""
    exact = exact_llamacpp_types(policy, arch)
    if exact is not None:
        return policy, exact
    pairs = policy.layer_pairs(arch.num_layers)
    k_dtype, v_dtype = (
        _most_precise({nearest_llamacpp_dtype(pair[i]) for pair in pairs}) for i in (0, 1)
    )
    nearest = KVPolicy(
        k_dtype=k_dtype,
        v_dtype=v_dtype,
        group_size=GGML_BLOCK,
        scale_dtype="fp16",
        rotation=LLAMACPP,
        tensor_scale="unit",
        block_size=policy.block_size,
        chunk_size=policy.chunk_size,
    )
    return nearest, None


def _most_precise(dtypes: set[str]) -> str:
    """auto, else the most bits, then a zero point (q4_1 keeps what q4_0 keeps), then registry
    order."""
    if AUTO in dtypes:
        return AUTO
    elements = most_precise_first(dtypes)
    return min(
        elements, key=lambda d: (-ELEMENT_FORMATS[d].bits, not ELEMENT_FORMATS[d].zero_point)
    )


def exact_source(exact: LlamaCppTypes) -> str:
    """Which presets store the policy's streams, for NOTES.md."""
    k_preset, v_preset = exact.presets
    if k_preset == v_preset and k_preset is not None:
        return f"preset `{k_preset}`"
    named = [
        f"{stream} as preset `{preset}`" if preset else f"{stream} as the model's fp32 values"
        for stream, preset in (("K", k_preset), ("V", v_preset))
    ]
    return ", ".join(named)


def slot_context(serve: ServeSettings) -> int:
    """Tokens a slot holds: the workload's context (its typical one where given) rounded up to
    llama.cpp's multiple of 256."""
    tokens = serve.typical_context_len
    return math.ceil(tokens / CONTEXT_PAD) * CONTEXT_PAD


def server_slots(
    arch: ModelArch, equivalent: KVPolicy, device: DeviceSpec, serve: ServeSettings
) -> int:
    """--parallel: slots of `slot_context` tokens the target device fits (the planner's
    arithmetic for the policy llama.cpp stores; at least 1, at most MAX_SLOTS)."""
    at_slot = ServeSettings(
        max_model_len=slot_context(serve),
        gpu_memory_utilization=serve.gpu_memory_utilization,
        activation_reserve_gib=serve.activation_reserve_gib,
    )
    budget = kv_budget_bytes(arch, device, serve)
    fits = capacity_row(LLAMACPP, arch, equivalent, device, at_slot, budget).max_num_seqs
    return min(MAX_SLOTS, max(1, fits))


def llama_server_args(
    equivalent: KVPolicy, arch: ModelArch, slots: int, serve: ServeSettings
) -> list[str]:
    """llama-server options, one per line: the cache types, flash attention where V is
    quantized (llama.cpp refuses a quantized V without it), the total context and the slots."""
    k_type, v_type = stream_types(equivalent, arch)
    args = [f"--cache-type-k {k_type}", f"--cache-type-v {v_type}"]
    [(_, v_dtype)] = set(equivalent.layer_pairs(arch.num_layers))
    if ELEMENT_FORMATS[stored_format(v_dtype, arch)].quantized:
        args.append("--flash-attn on")
    return [*args, f"--ctx-size {slots * slot_context(serve)}", f"--parallel {slots}"]


def llamacpp_gaps(policy: KVPolicy, arch: ModelArch) -> list[str]:
    """What llama.cpp cannot express of this policy, one line each (none when it stores it)."""
    if exact_llamacpp_types(policy, arch) is not None:
        return []
    gaps = []
    pairs = policy.layer_pairs(arch.num_layers)
    for index, flag in ((0, "k"), (1, "v")):
        dtypes = sorted({pair[index] for pair in pairs})
        if len(dtypes) > 1:
            gaps.append(
                f"per-layer {flag.upper()} dtypes ({', '.join(dtypes)}): llama.cpp has one "
                f"--cache-type-{flag} for every layer"
            )
    dtypes = {d for pair in pairs for d in pair if d != AUTO}
    for dtype in sorted(d for d in dtypes if ELEMENT_FORMATS[d].ggml_type is None):
        gaps.append(
            f"{dtype} ({KV_DTYPE_INFO[dtype].description}): llama.cpp has no such type "
            f"(exported as {nearest_llamacpp_dtype(dtype)})"
        )
    ours = sorted(d for d in dtypes if ELEMENT_FORMATS[d].ggml_block)
    for index, group in ((0, policy.key_group_size), (1, policy.group_size)):
        grouped = sorted({p[index] for p in pairs if p[index] in ours})
        if grouped and group != GGML_BLOCK:
            gaps.append(
                f"{', '.join(grouped)} {'keys' if index == 0 else 'values'} in groups of "
                f"{group}: llama.cpp's blocks are {GGML_BLOCK}"
            )
    if policy.k_scale_axis == "channel":
        gaps.append(
            f"per-channel key scales (one per channel in each block of {policy.block_size}): "
            f"llama.cpp scales keys per token, in blocks of {GGML_BLOCK} along head_dim"
        )
    if ours and policy.rotation != LLAMACPP:
        rotation = (
            "unrotated" if policy.rotation == NO_ROTATION else f"the {policy.rotation} rotation of"
        )
        gaps.append(
            f"{rotation} {', '.join(ours)}: llama.cpp rotates quantized streams by its own "
            "Walsh-Hadamard blocks (LLAMA_ATTN_ROT_DISABLE=1 in its environment turns that off)"
        )
    if policy.recent_unquantized:
        gaps.append(
            f"the {policy.recent_unquantized} most recent tokens kept in fp16: llama.cpp stores "
            "every token in its cache types"
        )
    if policy.compressed or policy.keeps or policy.selects:
        gaps.append(
            "CSA compression, selection and keeping: llama.cpp keeps every token of every "
            "sequence in its cache (capacity below)"
        )
    return gaps
