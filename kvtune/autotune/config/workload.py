"""The traffic a study tunes for: context and output lengths, concurrency and a request trace.

A workload preset (conf/workload/*.yaml) fixes where the objectives are measured: the KV bytes
of one sequence at `context_len` tokens, the time per output token with `batch` sequences of
that context decoding together, and the P99 latency of a short seeded trace whose prompt and
output lengths follow log-normal distributions and whose requests arrive as a Poisson process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtune.runtime.errors import ConfigError


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, value, "a positive integer")
    return value


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: log-normal around `median` (spread `sigma`), clipped to [min, max]."""

    median: int
    min: int
    max: int
    sigma: float = 0.5

    @classmethod
    def from_dict(cls, field: str, data: Mapping[str, Any]) -> LengthDistribution:
        known = {"median", "min", "max", "sigma"}
        if not isinstance(data, Mapping) or set(data) - known:
            raise ConfigError(field, data, f"a mapping with keys {', '.join(sorted(known))}")
        median = _positive_int(f"{field}.median", data.get("median"))
        low = _positive_int(f"{field}.min", data.get("min"))
        high = _positive_int(f"{field}.max", data.get("max"))
        if not low <= median <= high:
            raise ConfigError(field, dict(data), "min <= median <= max")
        sigma = data.get("sigma", 0.5)
        if isinstance(sigma, bool) or not isinstance(sigma, int | float) or sigma < 0:
            raise ConfigError(f"{field}.sigma", sigma, "a number >= 0")
        return cls(median, low, high, float(sigma))

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        draws = rng.lognormal(math.log(self.median), self.sigma, size=count)
        return [int(np.clip(round(x), self.min, self.max)) for x in draws]


@dataclass(frozen=True)
class TraceRequest:
    """One request of the latency trace: arrival offset (s), prompt and output lengths."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


# Fields a workload preset may leave out (their dataclass defaults apply).
OPTIONAL_FIELDS = frozenset({"suite"})


@dataclass(frozen=True)
class Workload:
    """Where a study measures.

    context_len: tokens a typical sequence holds (prompt + output) for the KV objective and
        the TPOT measurement.
    max_model_len: longest sequence served (capacity and the exported engine configs).
    batch: sequences decoding together when TPOT is measured.
    decode_tokens: tokens each of them generates while TPOT is timed.
    trace_requests, arrival_rate, seed: size, Poisson rate (requests/s) and seed of the P99
        trace (one seed: every trial replays the same requests).
    suite: the accuracy suite (conf/eval/<suite>.yaml) whose contexts match this traffic's, so
        a study judges accuracy at the lengths it measures bytes and latency at; a study's
        `eval=` overrides it. Studies stored before workloads named one read `quick`.
    """

    name: str
    context_len: int
    max_model_len: int
    batch: int
    decode_tokens: int
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    trace_requests: int
    arrival_rate: float
    seed: int
    suite: str = "quick"

    def __post_init__(self) -> None:
        if not isinstance(self.suite, str) or not self.suite:
            raise ConfigError("workload.suite", self.suite, "a suite preset name (conf/eval)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("workload.seed", self.seed, "an integer")
        for field in ("context_len", "max_model_len", "batch", "trace_requests"):
            _positive_int(f"workload.{field}", getattr(self, field))
        if isinstance(self.decode_tokens, bool) or not isinstance(self.decode_tokens, int):
            raise ConfigError("workload.decode_tokens", self.decode_tokens, "an integer >= 2")
        if self.decode_tokens < 2:
            raise ConfigError("workload.decode_tokens", self.decode_tokens, "an integer >= 2")
        if self.context_len <= self.decode_tokens:
            raise ConfigError(
                "workload.context_len", self.context_len, f"> decode_tokens={self.decode_tokens}"
            )
        longest = self.prompt_len.max + self.output_len.max
        if max(self.context_len, longest) > self.max_model_len:
            raise ConfigError(
                "workload.max_model_len",
                self.max_model_len,
                f">= context_len and prompt_len.max + output_len.max ({longest})",
            )
        rate = self.arrival_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise ConfigError("workload.arrival_rate", self.arrival_rate, "a number > 0 (req/s)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in fields:
                raise ConfigError(f"workload.{key}", data[key], "unknown field")
        for key in fields - OPTIONAL_FIELDS:
            if data.get(key) is None:
                raise ConfigError(f"workload.{key}", None, "a value (missing)")
        values = dict(data)
        for key in ("prompt_len", "output_len"):
            values[key] = LengthDistribution.from_dict(f"workload.{key}", values[key])
        return cls(**{**values, "name": str(values["name"])})

    def trace(self) -> list[TraceRequest]:
        """The seeded latency trace: the same requests for every trial of a study."""
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0 / self.arrival_rate, size=self.trace_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
        prompts = self.prompt_len.sample(rng, self.trace_requests)
        outputs = self.output_len.sample(rng, self.trace_requests)
        return [
            TraceRequest(float(t), p, o) for t, p, o in zip(arrivals, prompts, outputs, strict=True)
        ]
