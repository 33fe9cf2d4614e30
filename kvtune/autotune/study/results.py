"""A study's results as plain records: the Pareto front, the picks export offers, the CSV.

The front is computed here from the recorded metrics (feasible COMPLETE trials, the study's
objectives and directions) so MLflow tags, plots, the final table and exports agree.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from kvtune.autotune.study.objectives import MAXIMIZE, METRICS
from kvtune.autotune.study.optuna_study import (
    POLICY_ATTR,
    SURPLUS_ATTR,
    policy_key,
    screened_out,
    trial_reason,
)
from kvtune.runtime.arch import GIB
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPE_INFO, KV_DTYPES
from kvtune.runtime.policy import KVPolicy

PICKS = ("knee", "max_accuracy", "min_memory")
TRIAL_PICK = "trial="


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the reports need it."""

    number: int
    state: str
    policy: KVPolicy | None
    metrics: dict[str, float]
    feasible: bool
    failure_reason: str | None
    warm_start: str | None

    @property
    def complete(self) -> bool:
        return self.state == TrialState.COMPLETE.name


def trial_records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial that measured a policy, one per policy (the first; studies made before
    duplicates were refused may hold repeats), without surplus and duplicate trials (pruned
    before measuring anything); a screened-out trial is listed with its reason."""
    records = []
    seen: set[str] = set()
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        pruned = trial.state == TrialState.PRUNED and not screened_out(trial)
        if attrs.get(SURPLUS_ATTR) or trial.state == TrialState.WAITING or pruned:
            continue
        policy = attrs.get(POLICY_ATTR)
        if policy:
            key = policy_key(policy)
            if key in seen:
                continue
            seen.add(key)
        records.append(
            TrialRecord(
                number=trial.number,
                state=trial.state.name,
                policy=KVPolicy.from_dict(policy) if policy else None,
                metrics=dict(attrs.get("metrics", {})),
                feasible=all(v <= 0 for v in trial.constraints.values()),
                failure_reason=trial_reason(trial),
                warm_start=attrs.get("warm_start"),
            )
        )
    return records


def _oriented(record: TrialRecord, objectives: Sequence[str]) -> list[float]:
    """Objective values turned so that smaller is better."""
    return [
        -record.metrics[n] if METRICS[n].direction == MAXIMIZE else record.metrics[n]
        for n in objectives
    ]


def pareto_front(records: Sequence[TrialRecord], objectives: Sequence[str]) -> list[TrialRecord]:
    """Non-dominated feasible complete trials (equal points all stay), by trial number."""
    candidates = [r for r in records if r.complete and r.feasible]
    points = {r.number: _oriented(r, objectives) for r in candidates}

    def dominated(a: list[float]) -> bool:
        return any(
            all(x <= y for x, y in zip(b, a, strict=True)) and b != a for b in points.values()
        )

    return [r for r in candidates if not dominated(points[r.number])]


def knee(front: Sequence[TrialRecord], objectives: Sequence[str]) -> TrialRecord:
    """The front point closest to the ideal point after scaling each objective to [0, 1]."""
    oriented = [_oriented(r, objectives) for r in front]
    lows = [min(col) for col in zip(*oriented, strict=True)]
    highs = [max(col) for col in zip(*oriented, strict=True)]

    def distance(point: list[float]) -> float:
        return math.hypot(
            *[
                (v - lo) / (hi - lo) if hi > lo else 0.0
                for v, lo, hi in zip(point, lows, highs, strict=True)
            ]
        )

    best = min(range(len(front)), key=lambda i: (distance(oriented[i]), front[i].number))
    return front[best]


def pick_trial(
    records: Sequence[TrialRecord],
    objectives: Sequence[str],
    pick: str,
    min_retention: float | None = None,
    max_kv_gib: float | None = None,
) -> TrialRecord:
    """The trial an export names: knee | max_accuracy | min_memory | trial=<n>.

    The filters (minimum retention, maximum KV GiB per sequence at the workload's context)
    narrow the feasible complete trials first; trial=<n> ignores them.
    """
    if pick.startswith(TRIAL_PICK):
        number = pick.removeprefix(TRIAL_PICK)
        found = [r for r in records if str(r.number) == number and r.complete]
        if not found:
            done = ", ".join(str(r.number) for r in records if r.complete)
            raise ConfigError("pick", pick, f"trial=<n> of a complete trial: {done}")
        return found[0]
    if pick not in PICKS:
        raise ConfigError("pick", pick, f"one of {', '.join(PICKS)}, or trial=<n>")
    candidates = [r for r in records if r.complete and r.feasible]
    if min_retention is not None:
        candidates = [r for r in candidates if r.metrics["accuracy_retention"] >= min_retention]
    if max_kv_gib is not None:
        candidates = [
            r for r in candidates if r.metrics["kv_bytes_per_sequence"] <= max_kv_gib * GIB
        ]
    if not candidates:
        raise ConfigError(
            "pick",
            pick,
            "a study with a feasible complete trial that meets min_retention / max_kv_gib "
            "(none does: relax them or run more trials)",
        )
    if pick == "max_accuracy":
        return max(
            candidates,
            key=lambda r: (r.metrics["accuracy_retention"], -r.metrics["kv_bytes_per_sequence"]),
        )
    if pick == "min_memory":
        return min(
            candidates,
            key=lambda r: (r.metrics["kv_bytes_per_sequence"], -r.metrics["accuracy_retention"]),
        )
    return knee(pareto_front(candidates, objectives), objectives)


def policy_columns(policy: KVPolicy | None, num_layers: int) -> dict[str, Any]:
    """A policy flattened for tables: scalar fields, the per-layer pairs as a compact string
    (one K/V pair of table codes a layer, e.g. "a" auto, "h" fp16, "8" fp8, "i4" int4: each
    dtype's `table_code` in the format registry) and per-dtype layer counts."""
    if policy is None:
        return {}
    columns = {k: v for k, v in policy.to_dict().items() if k != "layer_dtypes"}
    if policy.layer_csa_topk is not None:
        columns["layer_csa_topk"] = " ".join(map(str, policy.layer_csa_topk))
    pairs = policy.layer_pairs(num_layers)
    codes = {dtype: info.table_code for dtype, info in KV_DTYPE_INFO.items()}
    columns["layers"] = " ".join(f"{codes[k]}{codes[v]}" for k, v in pairs)
    for side, index in (("k", 0), ("v", 1)):
        for dtype in KV_DTYPES:
            count = sum(pair[index] == dtype for pair in pairs)
            if count:
                columns[f"{side}_{dtype}_layers"] = count
    return columns


def write_trials_csv(
    records: Sequence[TrialRecord], front: Sequence[int], num_layers: int, path: Path
) -> None:
    """All trials, one row each: state, reason, Pareto membership, metrics, policy."""
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "trial": record.number,
            "state": record.state,
            "pareto": record.number in front,
            "feasible": record.feasible,
            "warm_start": record.warm_start or "",
            "failure_reason": record.failure_reason or "",
        }
        row.update(record.metrics)
        row.update(policy_columns(record.policy, num_layers))
        rows.append(row)
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def metric_table(record: TrialRecord) -> Mapping[str, float]:
    """The headline metrics of a trial, in report order."""
    order = [*METRICS, "kv_bytes_per_token", "p50_latency_ms"]
    return {name: record.metrics[name] for name in order if name in record.metrics}
