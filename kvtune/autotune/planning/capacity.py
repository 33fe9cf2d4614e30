"""Capacity planner: KV bytes, the KV budget and how many sequences fit, with advice.

Answers "how many sequences of this length fit on this card under this policy, and what would
the standard alternatives give" from the shared byte arithmetic: a sequence's bytes
(kvtune/runtime/kv_bytes.py) and, for the policies kvtune's engine serves, what that engine
sets aside beyond them (kvtune/runtime/pool_plan.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import (
    host_kv_bytes_per_sequence,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    max_fetch_bytes_per_step,
)
from kvtune.runtime.policy import PER_TENSOR, KVPolicy
from kvtune.runtime.pool_plan import pool_reserve

CSA_USEFUL_CONTEXT = 32768
OVERSIZED_CONTEXT_FACTOR = 4
SAFE_UTILIZATION = 0.95
LARGE_BLOCK = 128

# The standard alternatives every plan compares, as changes to the user's policy.
ALTERNATIVES: dict[str, dict[str, Any]] = {
    "fp16": {"k_dtype": "fp16", "v_dtype": "fp16", "csa_ratio": 1},
    "fp8": {"k_dtype": "fp8", "v_dtype": "fp8", "group_size": PER_TENSOR, "csa_ratio": 1},
    "fp4 g16": {
        "k_dtype": "fp4",
        "v_dtype": "fp4",
        "group_size": 16,
        "scale_dtype": "e4m3",
        "csa_ratio": 1,
    },
    "fp8 + csa2": {"k_dtype": "fp8", "v_dtype": "fp8", "group_size": PER_TENSOR, "csa_ratio": 2},
    "fp8 + csa4": {"k_dtype": "fp8", "v_dtype": "fp8", "group_size": PER_TENSOR, "csa_ratio": 4},
    "fp4 g16 + csa4": {
        "k_dtype": "fp4",
        "v_dtype": "fp4",
        "group_size": 16,
        "scale_dtype": "e4m3",
        "csa_ratio": 4,
    },
}

# What every alternative takes from the defaults instead of the user's policy: each is a plain
# format (no per-layer pairs, key-specific scales, fp16 recent or boundary layers) that pools
# older tokens at most; selection and importance keeping would make most of them invalid
# (selection needs compression) and the rest not standard. The rotation and the serving knobs
# stay the user's.
_PLAIN = KVPolicy()
PLAIN_FIELDS = (
    "layer_dtypes",
    "k_group_size",
    "k_scale_axis",
    "recent_unquantized",
    "boundary_layers",
    "csa_summary",
    "csa_topk",
    "layer_csa_topk",
    "csa_index",
    "csa_index_dtype",
    "csa_host",
    "csa_staging",
    "csa_select_every",
    "layer_csa_select_every",
    "csa_rescore",
    "csa_keep",
)


def kv_budget_bytes(arch: ModelArch, device: DeviceSpec, serve: ServeSettings) -> int:
    """Memory x utilization - weights - activation reserve (bytes, may be negative)."""
    usable = device.memory_gib * GIB * serve.gpu_memory_utilization
    return int(usable - arch.weights_bytes - serve.activation_reserve_gib * GIB)


def max_num_seqs(budget: int, sequence_bytes: int) -> int:
    return max(0, budget) // sequence_bytes if sequence_bytes else 0


def predicted_decode_ms(
    arch: ModelArch, device: DeviceSpec, sequences: int, sequence_bytes: int
) -> float:
    """Roofline floor of one decode step (ms): weights plus every sequence's KV read once."""
    moved = arch.weights_bytes + sequences * sequence_bytes
    return moved / (device.bandwidth_gbps * 1e9) * 1e3


@dataclass(frozen=True)
class CapacityRow:
    """One policy's figures on the plan's model, device and context.

    kv_bytes_per_sequence: what one sequence of the context holds (DESIGN.md section 1).
    reserve_bytes_per_sequence, reserve_bytes_shared: what kvtune's engine sets aside beyond
    that, for each sequence it runs and once (kvtune/runtime/pool_plan.py: the main pool's
    step slack, the fp16 recent pool's reserve, the host tier's prefill scratch); 0 for another
    engine's format, whose allocator is its own. max_num_seqs counts both.
    """

    name: str
    policy: KVPolicy
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    max_num_seqs: int
    predicted_decode_ms: float
    host_kv_bytes_per_sequence: int = 0
    max_fetch_bytes_per_step: int = 0
    reserve_bytes_per_sequence: int = 0
    reserve_bytes_shared: int = 0

    def allocated_bytes(self, sequences: int) -> int:
        """Device bytes the engine takes for `sequences` sequences of the context (0 for none)."""
        if sequences == 0:
            return 0
        per_sequence = self.kv_bytes_per_sequence + self.reserve_bytes_per_sequence
        return sequences * per_sequence + self.reserve_bytes_shared

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "policy": self.policy.to_dict(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "host_kv_bytes_per_sequence": self.host_kv_bytes_per_sequence,
            "max_fetch_bytes_per_step": self.max_fetch_bytes_per_step,
            "reserve_bytes_per_sequence": self.reserve_bytes_per_sequence,
            "reserve_bytes_shared": self.reserve_bytes_shared,
            "max_num_seqs": self.max_num_seqs,
            "predicted_decode_ms": round(self.predicted_decode_ms, 4),
        }


def engine_reserve_bytes(arch: ModelArch, policy: KVPolicy, context_len: int) -> tuple[int, int]:
    """(per sequence, once): device bytes kvtune's engine sets aside beyond the sequences' own
    when it serves sequences of context_len tokens, with its default step (chunk_size) and the
    host tier off the GPU."""
    reserve = pool_reserve(arch, policy, context_len, policy.chunk_size, host_tier_remote=True)
    per_sequence = kv_bytes_per_sequence(arch, policy, context_len)
    return reserve.bytes_per_sequence - per_sequence, reserve.shared_bytes


def capacity_row(
    name: str,
    arch: ModelArch,
    policy: KVPolicy,
    device: DeviceSpec,
    serve: ServeSettings,
    budget: int,
    *,
    engine_reserve: bool = False,
) -> CapacityRow:
    """The policy's figures at serve.max_model_len; engine_reserve: served by kvtune's engine,
    whose reserve counts against the budget (CapacityRow)."""
    per_sequence = kv_bytes_per_sequence(arch, policy, serve.max_model_len)
    reserve, shared = 0, 0
    if engine_reserve:
        reserve, shared = engine_reserve_bytes(arch, policy, serve.max_model_len)
    fits = max_num_seqs(budget - shared, per_sequence + reserve)
    return CapacityRow(
        name=name,
        policy=policy,
        kv_bytes_per_token=kv_bytes_per_token(arch, policy),
        kv_bytes_per_sequence=per_sequence,
        max_num_seqs=fits,
        predicted_decode_ms=predicted_decode_ms(arch, device, max(fits, 1), per_sequence),
        host_kv_bytes_per_sequence=host_kv_bytes_per_sequence(arch, policy, serve.max_model_len),
        max_fetch_bytes_per_step=max_fetch_bytes_per_step(arch, policy, serve.max_model_len),
        reserve_bytes_per_sequence=reserve,
        reserve_bytes_shared=shared,
    )


@dataclass(frozen=True)
class CapacityPlan:
    """The plan: the user's policy, the standard alternatives, and advice."""

    arch: ModelArch
    device: DeviceSpec
    serve: ServeSettings
    kv_budget_bytes: int
    chosen: CapacityRow
    compare: list[CapacityRow]
    warnings: list[str] = field(default_factory=list)
    max_num_seqs_at_expected_context: int | None = None

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen.to_dict()
        headroom = max(0, self.kv_budget_bytes) - self.chosen.allocated_bytes(
            self.chosen.max_num_seqs
        )
        result = {
            "model": self.arch.name,
            "device": self.device.name,
            "max_model_len": self.serve.max_model_len,
            "policy": chosen.pop("policy"),
            **{k: v for k, v in chosen.items() if k != "name"},
            "kv_budget_bytes": self.kv_budget_bytes,
            "headroom_bytes": headroom,
            "weights_bytes": self.arch.weights_bytes,
            "compare": [row.to_dict() for row in self.compare],
            "warnings": list(self.warnings),
        }
        if self.max_num_seqs_at_expected_context is not None:
            result["max_num_seqs_at_expected_context"] = self.max_num_seqs_at_expected_context
        return result


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def advice(
    arch: ModelArch,
    policy: KVPolicy,
    device: DeviceSpec,
    serve: ServeSettings,
    budget: int,
    row: CapacityRow,
) -> list[str]:
    """DESIGN.md section 6 advice that applies to this plan."""
    notes = []
    if budget <= 0:
        notes.append(
            f"No room for a KV cache: weights {_gib(arch.weights_bytes)} + reserve "
            f"{serve.activation_reserve_gib:.2f} GiB exceed {device.memory_gib:.1f} GiB x "
            f"{serve.gpu_memory_utilization}; use a larger device or smaller weights."
        )
    elif row.max_num_seqs == 0:
        notes.append(
            f"The KV budget {_gib(budget)} is below one {serve.max_model_len}-token sequence "
            f"({_gib(row.allocated_bytes(1))}): lower serve.max_model_len, quantize or compress."
        )
    context = serve.typical_context_len
    if policy.compressed and context < CSA_USEFUL_CONTEXT:
        notes.append(
            f"CSA (csa_ratio={policy.csa_ratio}) on {context}-token contexts: below ~32K it saves "
            "little time and can be slower; keep csa_ratio=1 as a candidate."
        )
    expected = serve.expected_context_len
    if expected and serve.max_model_len >= OVERSIZED_CONTEXT_FACTOR * expected:
        notes.append(
            f"max_model_len {serve.max_model_len} is far above the workload's {expected} tokens: "
            "capacity is planned for the maximum; lower max_model_len to fit more sequences."
        )
    if serve.max_model_len > arch.max_position_embeddings:
        notes.append(
            f"max_model_len {serve.max_model_len} exceeds the model's trained context "
            f"({arch.max_position_embeddings} tokens)."
        )
    if serve.gpu_memory_utilization > SAFE_UTILIZATION:
        notes.append(
            f"gpu_memory_utilization {serve.gpu_memory_utilization} leaves little room for "
            "temporary tensors and fragmentation (OOM although the sum fits): use 0.90."
        )
    if policy.block_size >= LARGE_BLOCK:
        notes.append(
            f"block_size {policy.block_size} wastes memory at sequence ends; "
            "16 is the usual default."
        )
    dtypes = {d for pair in policy.layer_pairs(arch.num_layers) for d in pair}
    few_levels = sorted(d for d in dtypes & set(ELEMENT_FORMATS) if ELEMENT_FORMATS[d].few_levels)
    coarse = policy.group_size == PER_TENSOR or policy.group_size >= 64
    if few_levels and coarse:
        notes.append(
            f"{', '.join(few_levels)} with coarse scales (group_size={policy.group_size}) loses "
            "accuracy (few code levels): use group 16-32, keep recent tokens unquantized, or "
            "FP8 for keys."
        )
    return notes


def build_plan(
    arch: ModelArch, policy: KVPolicy, device: DeviceSpec, serve: ServeSettings
) -> CapacityPlan:
    """Plan capacity for the user's policy and the standard alternatives."""
    budget = kv_budget_bytes(arch, device, serve)
    chosen = capacity_row("chosen", arch, policy, device, serve, budget, engine_reserve=True)
    compare = []
    for name, changes in ALTERNATIVES.items():
        try:
            plain = {name: getattr(_PLAIN, name) for name in PLAIN_FIELDS}
            alternative = policy.replace(**plain, **changes)
            row = capacity_row(name, arch, alternative, device, serve, budget, engine_reserve=True)
            compare.append(row)
        except ConfigError:
            continue  # this model cannot hold the alternative (e.g. group 16 on odd head_dim)
    at_expected = None
    if serve.expected_context_len:
        # What the engine fits with max_model_len lowered to the workload's context.
        at_context = dataclasses.replace(serve, max_model_len=serve.expected_context_len)
        row = capacity_row(
            "expected", arch, policy, device, at_context, budget, engine_reserve=True
        )
        at_expected = row.max_num_seqs
    return CapacityPlan(
        arch=arch,
        device=device,
        serve=serve,
        kv_budget_bytes=budget,
        chosen=chosen,
        compare=compare,
        warnings=advice(arch, policy, device, serve, budget, chosen),
        max_num_seqs_at_expected_context=at_expected,
    )
