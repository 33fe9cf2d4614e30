"""Deployable files for one trial: the kvtune policy, vLLM and SGLang configs, llama-server's
flags (llama.cpp, `kvtune.autotune.export.llamacpp`), and NOTES.md.

Engines express less than kvtune's policy. vLLM (`vllm serve --config vllm.yaml`) has one KV
dtype for every layer (`kv-cache-dtype`) plus `kv-cache-dtype-skip-layers`, the layers kept in
the model dtype; K and V share a dtype. SGLang has one `--kv-cache-dtype` for all layers.
Neither has CSA compression, an unquantized recent window, per-channel keys or kvtune's
rotation. When the policy stores exactly what an engine format stores (`exact_presets`, the
engine presets of conf/policy), the export names that format and the trial's accuracy carries
over. Otherwise, of the engine presets the study measured (study.engine_presets), the one with
the fewest bytes that measured at least as accurate as the trial serves: accuracy is judged by
measurement, not by bytes. Failing that it writes the nearest config by rule (FP8 per tensor
where a layer quantizes, the model dtype where it does not; SGLang's NVFP4 when every layer is
FP4; llama.cpp's types by `llamacpp.llamacpp_policy`), a different and unmeasured cache:
NOTES.md says so, compares its bytes with the policy's and gives its kvtune form to measure.
Option values were checked against vLLM 0.33.0's CacheConfig, SGLang 0.5.23's server arguments
and llama.cpp 0c1e570's common/arg.cpp (docs/engine_formats.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtune.autotune.config.engine_presets import ENGINES
from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.autotune.export.exact_presets import LLAMACPP, ExactPreset, exact_preset
from kvtune.autotune.export.host_tier import (
    host_tier_bytes,
    host_tier_notes,
    sglang_hicache,
    vllm_offloading,
)
from kvtune.autotune.export.llamacpp import (
    MAX_SLOTS,
    exact_source,
    llama_server_args,
    llamacpp_gaps,
    llamacpp_policy,
    server_slots,
    slot_context,
    stream_types,
)
from kvtune.autotune.planning.capacity import CapacityRow, build_plan, capacity_row, kv_budget_bytes
from kvtune.autotune.study.objectives import capacity_metrics
from kvtune.autotune.study.recipe import TuneSetup
from kvtune.autotune.study.results import TrialRecord, metric_table
from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence, kv_bytes_per_token
from kvtune.runtime.kv_dtypes import (
    AUTO,
    KV_DTYPE_INFO,
    KV_DTYPES,
    most_precise_first,
    nearest_engine_dtype,
)
from kvtune.runtime.policy import NO_ROTATION, PER_TENSOR, KVPolicy

VLLM_CUDA_MAX_BLOCK = 32
NVFP4_GROUP = 16
# What the engines store for a format of each storage class (`nearest_engine` in the format
# registry) when none stores the format itself; FP8 per tensor is the nearest config's own.
NEAREST_STORAGE = "fp8"
PER_TENSOR_SCALES = "one scale per tensor"
ENGINE_STORAGE = {
    "fp8": "exported as FP8 (E4M3 with one scale per tensor; vLLM's fp8_per_token_head keeps "
    "one fp32 scale per vector)",
    "fp4": "the engines' FP4 caches are nvfp4 (E4M3 scales per 16 and a global scale; "
    "nvfp4_4over6 in vLLM; SGLang's fp4_mx_block16: power-of-two scales per 16), and vLLM's "
    "nearest config is FP8",
}
MIB = 1 << 20
# Where the engines have no counterpart (compression, selection): what KVPolicy does by default.
_DEFAULT_POLICY = KVPolicy()


def layer_levels(policy: KVPolicy, num_layers: int) -> list[str]:
    """Per layer, the least precise format an engine may use for both K and V: the more
    precise of the two streams' engine storage classes (auto when either stream is exact; fp4
    when both are FP4; else fp8, which keeps at least the precision of the integer and other
    formats no exported config stores; `FormatInfo.nearest_engine` in the format registry)."""
    return [
        most_precise_first(map(nearest_engine_dtype, pair))[0]
        for pair in policy.layer_pairs(num_layers)
    ]


def _engine_policy(
    policy: KVPolicy, pairs: Sequence[str], group: int | str, scale: str
) -> KVPolicy:
    """A kvtune policy that stores exactly what an engine would (for the byte arithmetic)."""
    return policy.replace(
        k_dtype="fp16",
        v_dtype="fp16",
        layer_dtypes=tuple(pairs),
        group_size=group,
        scale_dtype=scale,
        recent_unquantized=0,
        csa_ratio=1,
        csa_summary=_DEFAULT_POLICY.csa_summary,
        csa_topk=0,
        layer_csa_topk=None,
        csa_host=False,
        csa_index_dtype=_DEFAULT_POLICY.csa_index_dtype,
        csa_staging=_DEFAULT_POLICY.csa_staging,
        csa_select_every=1,
        layer_csa_select_every=None,
        csa_rescore=1,
        csa_keep=0.0,
    )


@dataclass(frozen=True)
class EngineMapping:
    """What an engine is told, and the kvtune policy that stores the same cache.

    preset: the engine preset ("vllm/nvfp4") whose codes equal the policy's, when the export is
    exact; None for a nearest config (a different cache).
    measured: the study's trial of an engine preset chosen because it measured at least as
    accurate as the policy (`nearest_measured`); None when the config was not measured.
    """

    kv_cache_dtype: str
    skip_layers: tuple[int, ...]
    equivalent: KVPolicy
    preset: str | None = None
    measured: TrialRecord | None = None


def _exact_mapping(policy: KVPolicy, arch: ModelArch, exact: ExactPreset) -> EngineMapping:
    pairs = [
        "auto/auto" if i in exact.skip_layers else "/".join(pair)
        for i, pair in enumerate(policy.layer_pairs(arch.num_layers))
    ]
    equivalent = policy.replace(layer_dtypes=tuple(pairs))
    return EngineMapping(exact.kv_cache_dtype, exact.skip_layers, equivalent, exact.name)


def vllm_mapping(policy: KVPolicy, arch: ModelArch) -> EngineMapping:
    """The vLLM format storing this policy's codes, else FP8 (E4M3, per-tensor scales) where
    the policy quantizes, skipped layers elsewhere."""
    exact = exact_preset(policy, arch, "vllm")
    if exact is not None:
        return _exact_mapping(policy, arch, exact)
    levels = layer_levels(policy, arch.num_layers)
    if all(level == AUTO for level in levels):
        pairs = ["auto/auto"] * arch.num_layers
        return EngineMapping("auto", (), _engine_policy(policy, pairs, PER_TENSOR, "fp16"))
    skip = tuple(i for i, level in enumerate(levels) if level == AUTO)
    pairs = ["auto/auto" if level == AUTO else "fp8/fp8" for level in levels]
    return EngineMapping("fp8_e4m3", skip, _engine_policy(policy, pairs, PER_TENSOR, "fp16"))


def engine_preset_trials(records: Sequence[TrialRecord], engine: str) -> list[TrialRecord]:
    """The study's completed trials of `engine`'s presets (study.engine_presets)."""
    return [
        r
        for r in records
        if r.complete
        and r.policy is not None
        and (r.warm_start or "").startswith(f"{engine}/")
        and "accuracy_retention" in r.metrics
    ]


def nearest_measured(
    mapping: EngineMapping,
    record: TrialRecord,
    records: Sequence[TrialRecord],
    arch: ModelArch,
    engine: str,
) -> EngineMapping:
    """An exact mapping as it is; otherwise, of the engine presets the study measured at least
    as accurate as the picked trial, the one with the fewest bytes (accuracy judged by the
    measurement, not by bytes); the rule's nearest config when none was."""
    target = record.metrics.get("accuracy_retention")
    if mapping.preset is not None or target is None:
        return mapping
    accurate = [
        r
        for r in engine_preset_trials(records, engine)
        if r.metrics["accuracy_retention"] >= target
    ]
    if not accurate:
        return mapping
    best = min(accurate, key=lambda r: kv_bytes_per_token(arch, r.policy))
    dtype = (best.warm_start or "").split("/", 1)[1]
    return EngineMapping(dtype, (), best.policy, None, best)


def sglang_mapping(policy: KVPolicy, arch: ModelArch) -> EngineMapping:
    """The SGLang format storing this policy's codes, else one dtype for all layers: the most
    precise any layer needs (NVFP4 when every layer is FP4)."""
    exact = exact_preset(policy, arch, "sglang")
    if exact is not None:
        return _exact_mapping(policy, arch, exact)
    levels = set(layer_levels(policy, arch.num_layers))
    layers = arch.num_layers
    if AUTO in levels:
        return EngineMapping("auto", (), _engine_policy(policy, ["auto/auto"] * layers, 32, "fp16"))
    if "fp8" in levels or arch.cached_vector_size % NVFP4_GROUP:
        pairs = ["fp8/fp8"] * layers
        return EngineMapping("fp8_e4m3", (), _engine_policy(policy, pairs, PER_TENSOR, "fp16"))
    pairs = ["fp4/fp4"] * layers
    return EngineMapping("nvfp4", (), _engine_policy(policy, pairs, NVFP4_GROUP, "e4m3"))


def llamacpp_mapping(policy: KVPolicy, arch: ModelArch) -> EngineMapping:
    """llama.cpp's K and V types storing this policy's codes (kv_cache_dtype "<K type>/<V
    type>", preset: which presets store them), else the nearest types (`llamacpp_policy`)."""
    equivalent, exact = llamacpp_policy(policy, arch)
    types = "/".join(stream_types(equivalent, arch))
    return EngineMapping(types, (), equivalent, None if exact is None else exact_source(exact))


def layer_ranges(items: Sequence[str]) -> list[str]:
    """Runs of equal per-layer values: ["layers 0-9: fp8/fp8", "layer 10: auto/auto"]."""
    runs: list[list[Any]] = []
    for index, item in enumerate(items):
        if runs and runs[-1][2] == item:
            runs[-1][1] = index
        else:
            runs.append([index, index, item])
    return [
        f"layer {first}: {item}" if first == last else f"layers {first}-{last}: {item}"
        for first, last, item in runs
    ]


def index_ranges(indices: Sequence[int]) -> str:
    """Sorted layer indices as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def compact_policy(policy: KVPolicy, num_layers: int) -> str:
    """A policy for people: the per-layer K/V pairs as ranges, then the other fields."""
    pairs = ["/".join(pair) for pair in policy.layer_pairs(num_layers)]
    others = {k: v for k, v in policy.to_dict().items() if k not in ("k_dtype", "v_dtype")}
    others.pop("layer_dtypes")
    fields = ", ".join(f"{k}={v}" for k, v in others.items())
    return f"{'; '.join(layer_ranges(pairs))} ({fields})"


def engine_max_num_seqs(
    arch: ModelArch, mapping: EngineMapping, device: DeviceSpec, serve: ServeSettings
) -> int:
    """max-num-seqs for an engine: how many sequences of the workload's context its nearest
    config fits on the target device (the planner's arithmetic; at least 1)."""
    return max(1, _capacity("engine", arch, mapping.equivalent, device, serve).max_num_seqs)


def _capacity(
    name: str, arch: ModelArch, policy: KVPolicy, device: DeviceSpec, serve: ServeSettings
) -> CapacityRow:
    """Capacity at the workload's typical context (expected_context_len)."""
    at_context = ServeSettings(
        max_model_len=serve.typical_context_len,
        gpu_memory_utilization=serve.gpu_memory_utilization,
        activation_reserve_gib=serve.activation_reserve_gib,
    )
    return capacity_row(
        name, arch, policy, device, at_context, kv_budget_bytes(arch, device, serve)
    )


def vllm_config(
    policy: KVPolicy, mapping: EngineMapping, serve: ServeSettings, max_num_seqs: int
) -> dict[str, Any]:
    """Keys of `vllm serve --config` (flat YAML of long option names; lists give one value
    each, true flags are passed, false ones dropped by vLLM's loader)."""
    config: dict[str, Any] = {"kv-cache-dtype": mapping.kv_cache_dtype}
    if mapping.skip_layers:
        config["kv-cache-dtype-skip-layers"] = [str(i) for i in mapping.skip_layers]
    config.update(
        {
            "block-size": policy.block_size,
            "enable-chunked-prefill": True,
            # vLLM requires max_num_batched_tokens >= max_num_seqs.
            "max-num-batched-tokens": max(policy.chunk_size, max_num_seqs),
            "max-num-seqs": max_num_seqs,
            "max-model-len": serve.max_model_len,
            "gpu-memory-utilization": serve.gpu_memory_utilization,
        }
    )
    return config


def sglang_args(
    policy: KVPolicy, mapping: EngineMapping, serve: ServeSettings, max_running: int
) -> list[str]:
    """`python -m sglang.launch_server` options, one per line."""
    return [
        f"--kv-cache-dtype {mapping.kv_cache_dtype}",
        f"--page-size {policy.block_size}",
        f"--chunked-prefill-size {policy.chunk_size}",
        f"--max-running-requests {max_running}",
        f"--mem-fraction-static {serve.gpu_memory_utilization}",
        f"--context-length {serve.max_model_len}",
    ]


def _format_gaps(policy: KVPolicy, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """One line per family of the quantized element formats in pairs (formats sharing their
    registered description) and their scales, where no engine config stores them as the policy
    does: all but FP8 with one scale per tensor, the nearest config's own storage."""
    streams = {"keys": _scales(policy, keys=True), "values": _scales(policy, keys=False)}
    families: dict[tuple[str, str], set[str]] = {}
    for index, (stream, scales) in enumerate(streams.items()):
        if streams["keys"] != streams["values"]:
            scales += f" ({stream})"
        dtypes = {pair[index] for pair in pairs} & set(QUANTIZED_DTYPES)
        for dtype in sorted(dtypes, key=KV_DTYPES.index):
            if (dtype, streams[stream]) != (NEAREST_STORAGE, PER_TENSOR_SCALES):
                description = KV_DTYPE_INFO[dtype].description
                families.setdefault((description, scales), set()).add(dtype)
    return [
        f"{', '.join(sorted(dtypes))}: {description}; {scales}; "
        f"{ENGINE_STORAGE[nearest_engine_dtype(min(dtypes))]}"
        for (description, scales), dtypes in families.items()
    ]


def _scales(policy: KVPolicy, keys: bool) -> str:
    """The scales of the policy's key or value streams, in words."""
    if keys and policy.k_scale_axis == "channel":
        return f"{policy.scale_dtype} scales, one per channel in each block of {policy.block_size}"
    group = policy.key_group_size if keys else policy.group_size
    if group == PER_TENSOR:
        return PER_TENSOR_SCALES
    return f"{policy.scale_dtype} scales, one per group of {group}"


def _policy_gaps(policy: KVPolicy, arch: ModelArch, formats_exported: bool) -> list[str]:
    """What no engine config here expresses, for this policy (its element and scale formats
    are left out when formats_exported: an engine stores them exactly)."""
    gaps = []
    pairs = [] if formats_exported else policy.layer_pairs(arch.num_layers)
    if any(k != v for k, v in pairs):
        gaps.append("different K and V dtypes in a layer (engines store K and V alike)")
    if len(set(pairs)) > 1:
        gaps.append("per-layer dtype mixtures beyond vLLM's skip list (SGLang: none at all)")
    gaps += _format_gaps(policy, pairs)
    if policy.rotation != NO_ROTATION and not formats_exported:
        gaps.append(f"the {policy.rotation} rotation of K and V (no exported config rotates)")
    if policy.recent_unquantized:
        gaps.append(f"the {policy.recent_unquantized} most recent tokens kept in fp16")
    if policy.compressed:
        summaries = (
            f"ratio {policy.csa_ratio}, summaries pooled {policy.csa_summary.replace('_', '-')}"
            if policy.summarises
            else "no summaries: older blocks not selected are skipped"
        )
        gaps.append(
            f"CSA compression ({summaries}, {policy.csa_sinks} sinks, window "
            f"{policy.csa_window}): no engine compresses the cache; the engines keep every "
            "token (capacity below)"
        )
    if policy.keeps:
        gaps.append(
            f"older blocks kept exact by the attention they received ({policy.csa_keep:g} of "
            "each group of 8, per layer and KV head, beside their summaries): no engine keeps "
            "part of an evicted context; the engines keep every token on the device"
        )
    if policy.selects:
        scored_on = {"bounds": "key bounds", "means": "mean keys", "summaries": "summaries"}
        index = f", scored on {scored_on[policy.csa_index]}"
        if policy.separate_index:
            index += f" in a {policy.csa_index_dtype} index of their own"
        if policy.streams_staging:
            index += (
                ", fetched a layer at a time into one staging pool the layers share (every "
                "step fetches every layer's choice)"
            )
        if policy.csa_select_every > 1:
            index += (
                f", each choice reused for {policy.csa_select_every} positions (made by the "
                "query at the latest multiple of it)"
            )
            if policy.layer_csa_select_every:
                by_layer = ", ".join(map(str, policy.layer_csa_select_every))
                index += f" where a layer's N says so (by layer: {by_layer})"
        if policy.csa_rescore > 1:
            index += (
                f", {policy.csa_rescore} x the budget shortlisted there and decided by their "
                "exact keys in the host tier"
            )
        budget = f"{policy.csa_topk} older blocks"
        if policy.layer_csa_topk:
            budget = (
                f"{min(policy.layer_csa_topk)}-{policy.csa_topk} older blocks (by layer: "
                f"{', '.join(map(str, policy.layer_csa_topk))})"
            )
        gaps.append(
            f"query-aware selection of {budget} per query from a host-memory "
            f"tier{index}: neither engine expresses it for this model (SGLang's hisparse exists "
            "only for DeepSeek sparse-attention models); the engines keep every token on the "
            "device"
        )
    return gaps


def _engine_lines(
    name: str, mapping: EngineMapping, record: TrialRecord, setup: TuneSetup
) -> list[str]:
    """Whether a vLLM or SGLang config serves this trial's cache, and if not, what it costs and
    what it measured (or how to measure it)."""
    policy = record.policy
    assert policy is not None
    skip = (
        f", kv-cache-dtype-skip-layers {index_ranges(mapping.skip_layers)}"
        if mapping.skip_layers
        else ""
    )
    head = f"- {name}: kv-cache-dtype {mapping.kv_cache_dtype}{skip}"
    unit = policy.tensor_scale == "unit"
    return _mapping_lines(head, mapping, f"preset `{mapping.preset}`", unit, record, setup)


def _llamacpp_lines(mapping: EngineMapping, record: TrialRecord, setup: TuneSetup) -> list[str]:
    """The same for llama-server (its types carry no tensor scale: the codes are the same)."""
    k_type, v_type = stream_types(mapping.equivalent, setup.arch)
    head = f"- llama.cpp: --cache-type-k {k_type} --cache-type-v {v_type}"
    return _mapping_lines(head, mapping, mapping.preset or "", True, record, setup)


def _mapping_lines(
    head: str,
    mapping: EngineMapping,
    source: str,
    same_codes: bool,
    record: TrialRecord,
    setup: TuneSetup,
) -> list[str]:
    """An engine line (head) and what it says: exact (stored as `source` stores it; same_codes:
    the engine's per-tensor scale is the policy's), measured or nearest."""
    arch = setup.arch
    policy = record.policy
    assert policy is not None
    if mapping.preset is not None and same_codes:
        return [
            f"{head}: the same codes as this policy ({source}), so the accuracy measured here "
            "carries over."
        ]
    if mapping.preset is not None:
        return [
            f"{head}: the same format as this policy ({source}), but the engine "
            "reads its fp32 per-layer scale from the checkpoint (1.0 without one) where kvtune "
            f"calibrated it, so codes can differ: `kvtune evaluate policy={mapping.preset}` "
            "measures what the engine stores."
        ]
    tokens = setup.workload.context_len
    ratio = kv_bytes_per_sequence(arch, mapping.equivalent, tokens) / kv_bytes_per_sequence(
        arch, policy, tokens
    )
    size = "fewer" if ratio < 1 else "more"
    if mapping.measured is not None:
        measured = mapping.measured
        return [
            f"{head}: not this policy's cache, but this study measured it at least as accurate "
            f"(trial {measured.number}, preset `{measured.warm_start}`): retention "
            f"{measured.metrics['accuracy_retention']:.3f} against the policy's "
            f"{record.metrics['accuracy_retention']:.3f}, at {ratio:.2f}x the policy's bytes "
            f"({size})."
        ]
    return [
        f"{head}: the nearest config, not this policy's cache. It stores {ratio:.2f}x the "
        f"policy's bytes ({size}), so the accuracy measured here does not carry over: evaluate "
        "its kvtune form before serving it.",
        f"  kvtune form: {compact_policy(mapping.equivalent, arch.num_layers)}",
    ]


def _measured_presets_table(
    record: TrialRecord, records: Sequence[TrialRecord], setup: TuneSetup
) -> list[str]:
    """The engine presets this study measured, beside the picked trial (none: no lines)."""
    presets = [r for engine in ENGINES for r in engine_preset_trials(records, engine)]
    if not presets:
        return []
    tokens = setup.workload.context_len

    def row(label: str, r: TrialRecord) -> str:
        assert r.policy is not None
        mib = kv_bytes_per_sequence(setup.arch, r.policy, tokens) / MIB
        exact = r.metrics.get("exact_match_retention")
        exact_text = f"{exact:.3f}" if exact is not None else "-"
        return (
            f"| {label} | {r.number} | {r.metrics['accuracy_retention']:.3f} | {exact_text} | "
            f"{mib:,.2f} |"
        )

    return [
        "",
        f"Engine formats measured in this study (same suite; KV at {tokens} tokens):",
        "",
        "| config | trial | retention | exact-match retention | MiB/sequence |",
        "| --- | ---: | ---: | ---: | ---: |",
        row("this policy", record),
        *[row(f"`{r.warm_start}`", r) for r in presets],
    ]


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _row(label: str, row: CapacityRow) -> str:
    return (
        f"| {label} | {row.kv_bytes_per_token:,} | {row.kv_bytes_per_sequence / MIB:,.2f} | "
        f"{row.max_num_seqs:,} | {row.predicted_decode_ms:.3f} |"
    )


def notes_markdown(
    record: TrialRecord,
    setup: TuneSetup,
    device: DeviceSpec,
    serve: ServeSettings,
    engines: dict[str, EngineMapping],
    llamacpp: EngineMapping,
    study_name: str,
    pick: str,
    host_bytes: dict[str, int],
    records: Sequence[TrialRecord] = (),
) -> str:
    """NOTES.md: the picked trial's numbers, the gaps per engine (vLLM and SGLang, then
    llama.cpp), the engines' nearest host-tier settings (host_bytes: per engine, the host
    memory its config asks for), the engine formats the study measured, the capacity tables."""
    policy = record.policy
    assert policy is not None
    arch = setup.arch
    workload = setup.workload
    metrics = {
        **metric_table(record),
        **capacity_metrics(arch, policy, device, serve, workload),
    }
    lines = [
        f"# kvtune export: study `{study_name}`, pick `{pick}` (trial {record.number})",
        "",
        f"Model `{setup.model}` ({arch.num_layers} layers), workload `{workload.name}` "
        f"(context {workload.context_len} tokens, batch {workload.batch}, max_model_len "
        f"{workload.max_model_len}), target device `{device.name}`.",
        "",
        "## Measured and predicted (this trial)",
        "",
        f"Latencies were measured on the kvtune runtime ({setup.runtime.backend} backend, "
        f"{setup.runtime.device}, {setup.runtime.dtype}); accuracy on the `{setup.suite['name']}` "
        "suite; capacity and decode time are the planner's arithmetic for the target device "
        "(decode time is a roofline prediction, not a measurement).",
        "",
        "| metric | value |",
        "| --- | --- |",
        *[f"| {name} | {_number(value)} |" for name, value in metrics.items()],
        "",
        "## What vLLM and SGLang cannot express",
        "",
    ]
    exact = any(mapping.preset is not None for mapping in engines.values())
    gaps = _policy_gaps(policy, arch, formats_exported=exact)
    lines += [f"- {gap}" for gap in gaps] or ["- nothing: the engines store this policy as is"]
    lines += ["", "## What llama.cpp cannot express", ""]
    lines += [f"- {gap}" for gap in llamacpp_gaps(policy, arch)] or [
        "- nothing: llama.cpp stores this policy as is"
    ]
    lines += ["", "## The exported engine configs", ""]
    for name, mapping in engines.items():
        lines += _engine_lines(name, mapping, record, setup)
    lines += _llamacpp_lines(llamacpp, record, setup)
    host = host_tier_notes(policy, host_bytes, serve.typical_context_len)
    if host:
        lines += ["", "## Nearest settings for the host tier", "", *host]
    lines += _measured_presets_table(record, records, setup)
    lines += [
        "",
        f"## Capacity on {device.name} at the workload's context ({workload.context_len} tokens)",
        "",
        "| config | KV bytes/token | MiB/sequence | max_num_seqs | decode step, predicted (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
        _row("kvtune policy", _capacity("kvtune", arch, policy, device, serve)),
    ]
    for name, mapping in {**engines, "llama.cpp": llamacpp}.items():
        lines.append(
            _row(f"{name} nearest", _capacity(name, arch, mapping.equivalent, device, serve))
        )
    plan = build_plan(arch, policy, device, serve)
    lines += [
        "",
        f"## Planner: capacity at max_model_len ({serve.max_model_len} tokens)",
        "",
        f"KV budget {plan.kv_budget_bytes / MIB:,.0f} MiB ({device.memory_gib} GiB x "
        f"{serve.gpu_memory_utilization} - weights - {serve.activation_reserve_gib} GiB reserve).",
        "",
        "| config | KV bytes/token | MiB/sequence | max_num_seqs | decode step, predicted (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
        _row("kvtune policy", plan.chosen),
        *[_row(row.name, row) for row in plan.compare],
    ]
    if plan.warnings:
        lines += ["", "Planner advice:", "", *[f"- {w}" for w in plan.warnings]]
    lines += [
        "",
        "max-num-seqs / --max-running-requests: the sequences of the workload's context "
        f"({workload.context_len} tokens) that the nearest engine config fits on {device.name} "
        "(the capacity table above; at least 1); vLLM also needs "
        "max-num-batched-tokens >= max-num-seqs, so that is max(chunk_size, max-num-seqs).",
        "",
        f"llama-server's --parallel: slots of {slot_context(serve)} tokens (the workload's "
        "context rounded up to llama.cpp's multiple of 256) that its cache types fit on "
        f"{device.name}, at most {MAX_SLOTS} (llama.cpp's LLAMA_MAX_SEQ); --ctx-size is the "
        "total context over all slots (slots x "
        f"{slot_context(serve)}), which llama.cpp splits evenly between them, so a request "
        "longer than a slot does not fit (add --kv-unified to let the slots share the cells).",
    ]
    if policy.block_size > VLLM_CUDA_MAX_BLOCK:
        lines += [
            "",
            f"vLLM's CacheConfig documents block sizes up to {VLLM_CUDA_MAX_BLOCK} on CUDA; "
            f"block-size {policy.block_size} may be refused there (use 16 or 32).",
        ]
    return "\n".join(lines) + "\n"


def write_export(
    folder: Path,
    record: TrialRecord,
    setup: TuneSetup,
    device: DeviceSpec,
    study_name: str,
    pick: str,
    records: Sequence[TrialRecord] = (),
) -> list[Path]:
    """Write kvtune.yaml, vllm.yaml, sglang.args, llama-server.args and NOTES.md into folder;
    returns the paths. records: the study's trials, whose measured engine presets may serve as
    the engine config (`nearest_measured`) and are listed in NOTES.md."""
    policy = record.policy
    assert policy is not None
    serve = setup.serve
    arch = setup.arch
    engines = {
        "vLLM": nearest_measured(vllm_mapping(policy, arch), record, records, arch, "vllm"),
        "SGLang": nearest_measured(sglang_mapping(policy, arch), record, records, arch, "sglang"),
    }
    llamacpp = nearest_measured(llamacpp_mapping(policy, arch), record, records, arch, LLAMACPP)
    capacity = {name: engine_max_num_seqs(arch, m, device, serve) for name, m in engines.items()}
    host_bytes = {
        name: host_tier_bytes(arch, policy, serve, seqs) for name, seqs in capacity.items()
    }
    slots = server_slots(arch, llamacpp.equivalent, device, serve)
    folder.mkdir(parents=True, exist_ok=True)
    header = f"# kvtune policy: study {study_name}, pick {pick}, trial {record.number}\n"
    files = {
        "kvtune.yaml": header + policy.to_yaml(),
        "vllm.yaml": yaml.safe_dump(
            vllm_config(policy, engines["vLLM"], serve, capacity["vLLM"])
            | vllm_offloading(host_bytes["vLLM"]),
            sort_keys=False,
        ),
        "sglang.args": "\n".join(
            sglang_args(policy, engines["SGLang"], serve, capacity["SGLang"])
            + sglang_hicache(host_bytes["SGLang"])
        )
        + "\n",
        "llama-server.args": "\n".join(llama_server_args(llamacpp.equivalent, arch, slots, serve))
        + "\n",
        "NOTES.md": notes_markdown(
            record, setup, device, serve, engines, llamacpp, study_name, pick, host_bytes, records
        ),
    }
    paths = []
    for name, text in files.items():
        path = folder / name
        path.write_text(text)
        paths.append(path)
    return paths
