"""What one trial measures, which of it the study optimizes, and its constraints.

Every metric DESIGN.md section 5 asks a tuned result to state: accuracy retained against the
uncompressed baseline (per task and overall, from `kvtune.autotune.evaluation`), KV bytes of one
sequence at the workload's context (the shared byte arithmetic), TTFT and TPOT measured on the
runtime at the workload's batch and context, P99 latency of a seeded trace, how many such
sequences fit on the target device, and the roofline decode time predicted for that device.
Measured numbers are cached (kvtune/autotune/cache.py) in two parts: accuracy, keyed by the model's
content, the policy, the suite's content and the evaluation code; latency, keyed by the model,
the policy, the workload, the runtime, the machine and the timing code, so another machine
re-measures latencies but reuses accuracies. Arithmetic is recomputed, so the same cache serves
every target device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtune.autotune.cache import (
    ACCURACY_CODE,
    LATENCY_CODE,
    JsonCache,
    code_key,
    machine_fingerprint,
)
from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.autotune.config.workload import Workload
from kvtune.autotune.evaluation import evaluate, load_suite
from kvtune.autotune.evaluation.baseline_cache import suite_content_fingerprint
from kvtune.autotune.evaluation.evaluator import eval_cache_dir
from kvtune.autotune.planning.capacity import capacity_row, kv_budget_bytes, predicted_decode_ms
from kvtune.autotune.search.sensitivity import RuntimeSettings
from kvtune.autotune.study.latency import measure_latency
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.llm import LLM
from kvtune.runtime.policy import KVPolicy

logger = logging.getLogger(__name__)

MAXIMIZE, MINIMIZE = "maximize", "minimize"


@dataclass(frozen=True)
class Metric:
    """A trial metric: optimization direction and unit."""

    direction: str
    unit: str


METRICS: dict[str, Metric] = {
    "accuracy_retention": Metric(MAXIMIZE, "fraction of the uncompressed baseline"),
    "kv_bytes_per_sequence": Metric(MINIMIZE, "bytes at the workload's context_len"),
    "tpot_ms": Metric(MINIMIZE, "ms per output token, measured"),
    "ttft_ms": Metric(MINIMIZE, "ms to first token, measured"),
    "p99_latency_ms": Metric(MINIMIZE, "ms end to end over the trace, measured"),
    "max_num_seqs": Metric(MAXIMIZE, "sequences of context_len on the target device"),
    "predicted_decode_ms": Metric(MINIMIZE, "ms per decode step on the target, predicted"),
}
MAX_OBJECTIVES = 3
# Fidelity to the baseline and greedy exact-match retention, as the suite reports them
# (absent when no task measures them).
FIDELITY_METRICS = (
    "kl",
    "kl_prompt_tail",
    "top1_agreement",
    "answer_agreement",
    "exact_match_retention",
)


def parse_objectives(names: Sequence[str]) -> tuple[str, ...]:
    """Validated objective names (1 to 3 of METRICS, no repeats)."""
    if isinstance(names, str) or not 1 <= len(names) <= MAX_OBJECTIVES:
        raise ConfigError("objectives", names, f"a list of 1 to {MAX_OBJECTIVES} metric names")
    for name in names:
        if name not in METRICS:
            raise ConfigError("objectives", name, f"one of {', '.join(METRICS)}")
    if len(set(names)) != len(names):
        raise ConfigError("objectives", list(names), "names without repeats")
    return tuple(names)


def directions(objectives: Sequence[str]) -> list[str]:
    return [METRICS[name].direction for name in objectives]


@dataclass(frozen=True)
class Constraints:
    """Feasibility limits; each gives Optuna a value that is <= 0 when met.

    min_retention: accuracy_retention at least this; max_kv_gib: KV of one sequence at the
    workload's context at most this (GiB); min_num_seqs: at least this many such sequences fit.
    """

    min_retention: float | None = None
    max_kv_gib: float | None = None
    min_num_seqs: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Constraints:
        known = ("min_retention", "max_kv_gib", "min_num_seqs")
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"constraints.{key}", value, f"one of {', '.join(known)}")
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise ConfigError(f"constraints.{key}", value, "a number or null")
        return cls(**data)

    def values(self, metrics: Mapping[str, float]) -> dict[str, float]:
        limits = {}
        if self.min_retention is not None:
            limits["min_retention"] = self.min_retention - metrics["accuracy_retention"]
        if self.max_kv_gib is not None:
            limits["max_kv_gib"] = metrics["kv_bytes_per_sequence"] / GIB - self.max_kv_gib
        if self.min_num_seqs is not None:
            limits["min_num_seqs"] = self.min_num_seqs - metrics["max_num_seqs"]
        return limits


class TrialFailure(Exception):
    """A policy that could not be measured (OOM, NaN, a combination the runtime refuses); the
    study records the trial as FAIL with this reason and goes on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def capacity_metrics(
    arch: ModelArch, policy: KVPolicy, device: DeviceSpec, serve: ServeSettings, workload: Workload
) -> dict[str, float]:
    """Byte arithmetic and the planner's figures for the target device at the workload's
    context (nothing measured): capacity counts kvtune's engine reserve, as `kvtune plan` does;
    a policy with a host tier adds its host bytes and the most a decode step fetches."""
    at_context = dataclasses.replace(serve, max_model_len=workload.context_len)
    budget = kv_budget_bytes(arch, device, serve)
    row = capacity_row("trial", arch, policy, device, at_context, budget, engine_reserve=True)
    metrics = {
        "kv_bytes_per_sequence": float(row.kv_bytes_per_sequence),
        "kv_bytes_per_token": float(row.kv_bytes_per_token),
        "max_num_seqs": float(row.max_num_seqs),
        "predicted_decode_ms": predicted_decode_ms(
            arch, device, workload.batch, row.kv_bytes_per_sequence
        ),
    }
    if policy.selects:
        metrics["host_kv_bytes_per_sequence"] = float(row.host_kv_bytes_per_sequence)
        metrics["max_fetch_bytes_per_step"] = float(row.max_fetch_bytes_per_step)
    return metrics


@dataclass(frozen=True)
class TrialContext:
    """Everything a measurement depends on besides the policy."""

    model: str
    folder: Path
    arch: ModelArch
    device: DeviceSpec
    serve: ServeSettings
    workload: Workload
    suite: Mapping[str, Any]
    runtime: RuntimeSettings


def accuracy_metrics(policy: KVPolicy, context: TrialContext) -> dict[str, float]:
    """Accuracy retention, fidelity and per-task retention of the policy on the suite."""
    accuracy = evaluate(policy, context.suite)
    if accuracy.get("accuracy_retention") is None:
        raise TrialFailure(f"the {context.suite['name']} suite reported no accuracy_retention")
    fidelity = {k: float(accuracy[k]) for k in FIDELITY_METRICS if accuracy.get(k) is not None}
    return {
        "accuracy_retention": float(accuracy["accuracy_retention"]),
        **fidelity,
        "eval_seconds": float(accuracy["seconds"]),
        **{f"task.{name}": value for name, value in _task_retention(accuracy).items()},
    }


def latency_metrics(policy: KVPolicy, context: TrialContext) -> dict[str, float]:
    """TTFT, TPOT and trace latencies (ms) of the policy on the runtime at the workload's shape;
    latency_seconds: what loading and timing cost (s)."""
    started = time.perf_counter()
    workload = context.workload
    llm = LLM(
        context.model,
        policy,
        backend=context.runtime.backend,
        device=context.runtime.device,
        dtype=context.runtime.dtype,
        max_num_seqs=workload.batch,
        max_model_len=workload.max_model_len,
    )
    latency = measure_latency(llm, workload)
    measured = {k: float(v) for k, v in vars(latency).items()}
    return {**measured, "latency_seconds": time.perf_counter() - started}


def _task_retention(accuracy: Mapping[str, Any]) -> dict[str, float]:
    """Per-task retention from the evaluation's `tasks` (a number or a dict with one)."""
    tasks = accuracy.get("tasks") or {}
    result = {}
    for name, value in tasks.items():
        if isinstance(value, Mapping):
            value = value.get("accuracy_retention", value.get("retention"))
        if isinstance(value, int | float):
            result[name] = float(value)
    return result


class TrialEvaluator:
    """Measures policies for one study: cached measurements plus target-device arithmetic.

    machine: what timed the latencies (default: this one, autotune.cache.machine_fingerprint).
    """

    def __init__(
        self,
        context: TrialContext,
        cache: JsonCache | None,
        machine: Mapping[str, Any] | None = None,
    ) -> None:
        self.context = context
        self.cache = cache
        self.machine = dict(machine or machine_fingerprint(context.runtime.device))

    @functools.cached_property
    def model_hash(self) -> str:
        """The model files' content hash (their bytes read once a process)."""
        return model_fingerprint(self.context.folder)

    @functools.cached_property
    def suite_hash(self) -> str:
        """The suite's definition and generated task rows (the tasks written on first use)."""
        return suite_content_fingerprint(load_suite(self.context.suite), eval_cache_dir())

    def accuracy_key(self, policy: KVPolicy) -> dict[str, Any]:
        return {
            "kind": "accuracy",
            "model": self.model_hash,
            "policy": policy.to_dict(),
            "suite": self.suite_hash,
            "code": code_key(*ACCURACY_CODE),
        }

    def latency_key(self, policy: KVPolicy) -> dict[str, Any]:
        ctx = self.context
        workload = {k: v for k, v in dataclasses.asdict(ctx.workload).items() if k != "name"}
        return {
            "kind": "latency",
            "model": self.model_hash,
            "policy": policy.to_dict(),
            "workload": workload,
            "runtime": vars(ctx.runtime),
            "machine": self.machine,
            "code": code_key(*LATENCY_CODE),
        }

    def accuracy(self, policy: KVPolicy) -> tuple[dict[str, float], bool]:
        """The accuracy part alone (a screen's look): (metrics, whether from the cache)."""
        fresh: list[tuple[dict[str, Any], dict[str, float]]] = []
        with _trial_failures():
            metrics = self._measured(self.accuracy_key, accuracy_metrics, policy, fresh)
        self._store(fresh)
        return metrics, not fresh

    def __call__(self, policy: KVPolicy) -> tuple[dict[str, float], bool]:
        """(metrics, whether every measured part came from the cache); raises TrialFailure."""
        ctx = self.context
        fresh: list[tuple[dict[str, Any], dict[str, float]]] = []
        with _trial_failures():
            arithmetic = capacity_metrics(ctx.arch, policy, ctx.device, ctx.serve, ctx.workload)
            measured = {
                **self._measured(self.accuracy_key, accuracy_metrics, policy, fresh),
                **self._measured(self.latency_key, latency_metrics, policy, fresh),
            }
        measured["measure_seconds"] = measured["eval_seconds"] + measured["latency_seconds"]
        metrics = {**measured, **arithmetic}
        bad = [name for name, value in metrics.items() if not math.isfinite(value)]
        if bad:
            raise TrialFailure(f"non-finite metrics (NaN/inf): {', '.join(bad)}")
        self._store(fresh)
        return metrics, not fresh

    def _measured(
        self,
        key_of: Callable[[KVPolicy], dict[str, Any]],
        measure: Callable[[KVPolicy, TrialContext], dict[str, float]],
        policy: KVPolicy,
        fresh: list[tuple[dict[str, Any], dict[str, float]]],
    ) -> dict[str, float]:
        """One part's values from the cache, else measured (and listed in `fresh`)."""
        key = key_of(policy)
        values = self.cache.get(key) if self.cache else None
        if values is None:
            values = measure(policy, self.context)
            fresh.append((key, values))
        return values

    def _store(self, fresh: list[tuple[dict[str, Any], dict[str, float]]]) -> None:
        """Cache the parts measured now (only once the whole measurement is valid)."""
        if self.cache:
            for key, values in fresh:
                self.cache.put(key, values)


@contextlib.contextmanager
def _trial_failures() -> Iterator[None]:
    """What the runtime refuses or runs out of memory on, as a TrialFailure with its reason."""
    try:
        yield
    except ConfigError as error:
        raise TrialFailure(f"invalid combination: {error}") from error
    except (torch.OutOfMemoryError, MemoryError) as error:
        raise TrialFailure(f"out of memory: {error}") from error
