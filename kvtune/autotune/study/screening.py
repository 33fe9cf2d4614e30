"""Cheap first looks: a drawn policy passes a cheaper suite before it costs the study's own.

A trial at the workload's context costs minutes on this CPU at 2K and about an hour and a half
at 8K (benchmarks/RESULTS.md, "Long suites"), and many drawn policies land far below the
retention the study asks for. With `screen.suite` set, a policy the sampler drew is first
scored on that suite (an eval preset with fewer items at the same context, e.g. long8k-screen).
When its screening retention falls below `constraints.min_retention - screen.margin` it is
screened out: pruned, with the screening retention as its min_retention constraint value (so
TPE ranks it among the infeasible trials), never measured on the full suite and not counted in
study.n_trials. Once `screen.max_rejected` policies are screened out the study stops asking for
more. Warm starts and engine presets go straight to the full suite: they are chosen, not drawn.
How well a screen ranks policies like the full suite: benchmarks/screening.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy

# A screened-out trial's verdict (its user attr) and the screen's look at every drawn policy.
SCREENED_OUT_ATTR = "screened_out"
SCREEN_ATTR = "screen"


@dataclass(frozen=True)
class ScreenSettings:
    """The `screen` block. suite: eval preset of the cheap look (None: no screening);
    margin: how far below min_retention a screening retention may fall and still go on;
    max_rejected: policies screened out before the study stops drawing."""

    suite: str | None = None
    margin: float = 0.05
    max_rejected: int = 12

    def __post_init__(self) -> None:
        if self.suite is not None and (not isinstance(self.suite, str) or not self.suite):
            raise ConfigError("screen.suite", self.suite, "null or an eval preset name")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
            raise ConfigError("screen.margin", margin, "a number in [0, 1)")
        rejected = self.max_rejected
        if isinstance(rejected, bool) or not isinstance(rejected, int) or rejected < 1:
            raise ConfigError("screen.max_rejected", rejected, "an integer >= 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ScreenSettings:
        known = {"suite", "margin", "max_rejected"}
        for key, value in (data or {}).items():
            if key not in known:
                raise ConfigError(f"screen.{key}", value, f"one of {', '.join(sorted(known))}")
        return cls(**(data or {}))


@dataclass(frozen=True)
class ScreenVerdict:
    """One policy's look: its retention on the screening suite against the threshold."""

    suite: str
    retention: float
    threshold: float
    seconds: float
    cached: bool

    @property
    def passed(self) -> bool:
        return self.retention >= self.threshold

    @property
    def reason(self) -> str:
        return (
            f"screened out: retention {self.retention:.3f} on {self.suite} "
            f"< {self.threshold:.3f} (min_retention - screen.margin)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "accuracy_retention": self.retention,
            "threshold": self.threshold,
            "seconds": self.seconds,
            "cached": self.cached,
        }


class Screen:
    """Scores a policy on the screening suite. measure: the accuracy part of a trial's
    measurement on that suite, (metrics, whether from the cache)."""

    def __init__(
        self,
        settings: ScreenSettings,
        measure: Callable[[KVPolicy], tuple[dict[str, float], bool]],
        min_retention: float,
    ) -> None:
        if settings.suite is None:
            raise ValueError("a Screen needs screen.suite")
        self.settings = settings
        self.measure = measure
        self.min_retention = min_retention
        self.threshold = min_retention - settings.margin

    def __call__(self, policy: KVPolicy) -> ScreenVerdict:
        metrics, cached = self.measure(policy)
        return ScreenVerdict(
            suite=str(self.settings.suite),
            retention=float(metrics["accuracy_retention"]),
            threshold=self.threshold,
            seconds=float(metrics["eval_seconds"]),
            cached=cached,
        )
