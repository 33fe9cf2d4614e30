"""Per-layer settings: a policy's layer_* fields parsed, and expanded to one value a layer.

A policy names defaults (k_dtype, csa_topk, ...) and optional per-layer lists that override
them; the runtime, the planner and the exporter read the expanded lists from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES
from kvtune.runtime.policy.fields import Check, checked_int, field_name
from kvtune.runtime.policy.vocabulary import BOUNDARY_PAIR

if TYPE_CHECKING:
    from kvtune.runtime.policy.schema import KVPolicy


# Per-layer lists whose plain field is their largest: (field, its value when unset, why).
TAKE_LARGEST: tuple[tuple[str, int, str], ...] = (
    ("csa_topk", 0, " (the staging blocks a sequence holds)"),
    ("csa_select_every", 1, ""),
)


def layer_dtypes(name: str, value: Any) -> tuple[str, ...] | None:
    """layer_dtypes as a tuple of normalised "K/V" pairs (None when unset or empty)."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(field_name(name), value, 'a list of "K/V" pairs, or null')
    return tuple(_layer_pair(i, pair) for i, pair in enumerate(value)) or None


def layer_ints(minimum: int) -> Check:
    """A check of a per-layer list: a tuple of integers >= minimum, or None."""

    def check(name: str, value: Any) -> tuple[int, ...] | None:
        if value is None:
            return None
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            raise ConfigError(
                field_name(name), value, f"a list of integers >= {minimum} (one a layer), or null"
            )
        return tuple(checked_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(value))

    return check


def layer_budgets(name: str, value: Any) -> tuple[int, ...] | None:
    """layer_csa_topk: budgets >= 0, one of them above 0 (else the policy selects nothing)."""
    budgets = layer_ints(0)(name, value)
    if budgets is not None and max(budgets) == 0:
        raise ConfigError(
            field_name(name),
            list(budgets),
            "a list with a budget above 0, or null (a policy without selection has csa_topk 0)",
        )
    return budgets


def largest(fields: Mapping[str, Any], name: str, unset: int, why: str) -> int:
    """Field `name` where layer_<name> is set: their largest, which `name` must be already or
    leave unset (its `unset` value)."""
    values = fields["layer_" + name]
    if values is None:
        return fields[name]
    if fields[name] not in (unset, max(values)):
        raise ConfigError(
            field_name(name),
            fields[name],
            f"{max(values)}, the largest layer_{name}{why}, or {unset} to take it",
        )
    return max(values)


def _layer_pair(index: int, pair: object) -> str:
    """Normalise one per-layer entry "K/V" (for example "fp8/fp4")."""
    name = f"layer_dtypes[{index}]"
    parts = pair.split("/") if isinstance(pair, str) else []
    if len(parts) != 2:
        raise ConfigError(field_name(name), pair, 'a "K/V" pair such as "fp8/fp4"')
    k_dtype, v_dtype = (part.strip() for part in parts)
    for dtype in (k_dtype, v_dtype):
        if dtype not in KV_DTYPES:
            raise ConfigError(field_name(name), pair, f"K and V each one of {', '.join(KV_DTYPES)}")
    return f"{k_dtype}/{v_dtype}"


def layer_pairs(policy: KVPolicy, num_layers: int) -> list[tuple[str, str]]:
    """(K dtype, V dtype) of every layer, with the per-layer overrides applied."""
    if policy.layer_dtypes is None:
        pairs = [(policy.k_dtype, policy.v_dtype)] * num_layers
    elif len(policy.layer_dtypes) != num_layers:
        raise ConfigError(
            field_name("layer_dtypes"),
            f"<{len(policy.layer_dtypes)} entries>",
            f"exactly one K/V pair per layer: the model has {num_layers} layers",
        )
    else:
        pairs = [tuple(pair.split("/")) for pair in policy.layer_dtypes]  # type: ignore[misc]
    edge = min(policy.boundary_layers, num_layers // 2)
    return [
        BOUNDARY_PAIR if i < edge or i >= num_layers - edge else pair
        for i, pair in enumerate(pairs)
    ]


def per_layer(policy: KVPolicy, name: str, what: str, num_layers: int) -> list[int]:
    """Field `name` for every layer: its layer_ list, or its one value repeated."""
    values = getattr(policy, "layer_" + name)
    if values is None:
        return [getattr(policy, name)] * num_layers
    if len(values) != num_layers:
        raise ConfigError(
            field_name("layer_" + name),
            f"<{len(values)} entries>",
            f"exactly one {what} per layer: the model has {num_layers} layers",
        )
    return list(values)
