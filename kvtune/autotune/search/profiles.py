"""What the search space derives from the model's measured profiles instead of typed-in constants.

Two profiles, each measured on the model and cached by content: the fp4 sensitivity of each
layer (sensitivity.py) and where each layer's attention goes when an answer is due, at the
study's context (attention_profile.py). From them:

- selection groups: layers grouped by the older blocks they need, so the budget and its reuse
  are drawn per group of layers that retrieve alike (the K/V dtypes keep the sensitivity groups);
- per selection group, a budget share candidate: its neediest layer's need over the neediest
  layer's of all (a group's budget covers each of its layers: a layer read short of its need
  loses more than the bytes it saves, RESULTS.md "Attention profiles");
- a csa_topk candidate: the neediest layer's need, in blocks of the profile's block size;
- the warm starts beyond the baseline (`starts`): 4-bit codes where fp4 costs little, the most
  precise dtype in a group whose fp4 cost stands out, per-channel keys where the keys have
  channel outliers; then the same formats with selection at the profile's budgets, each group's
  choice reused where it persists, staged in one pool the layers share where the space can.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.autotune.search.attention_profile import AttentionProfile
from kvtune.autotune.search.sensitivity import group_layers
from kvtune.runtime.kv_dtypes import most_precise_first
from kvtune.runtime.policy import NO_SUMMARY

# A dtype group whose layers' mean fp4 cost is this many times the median layer's keeps the most
# precise dtype (Qwen2.5's first and last layers; SmolLM2 has none: RESULTS, per-layer formats).
PROTECT_RATIO = 4.0
# Per-token key scales are set by the largest channel: where the median layer's largest channel
# is twice its median channel, the median channel loses a bit of its codes, so keys scale per
# channel (KIVI).
CHANNEL_OUTLIERS = 2.0
# A group whose next choice keeps this share of the blocks it reads (its layers' mean) reuses it.
REUSE_OVERLAP = 0.8
FOUR_BIT = ("int4", "fp4")  # the 4-bit codes a formats start takes, in order of preference
SHARE_DIGITS = 2


@dataclass(frozen=True)
class Profiles:
    """The measured profiles a space derives from (None: not measured for this space)."""

    sensitivity: tuple[float, ...] | None = None
    attention: AttentionProfile | None = None

    def selection_groups(self, count: int, num_layers: int) -> tuple[tuple[int, ...], ...] | None:
        """`count` groups of layers by the older blocks they need (None: no attention profile)."""
        if self.attention is None:
            return None
        if count == num_layers:
            return tuple((layer,) for layer in range(num_layers))
        return group_layers(self.attention.blocks_needed, count)

    def group_needs(self, groups: Sequence[Sequence[int]]) -> list[float]:
        """The older blocks each group's neediest layer needs."""
        assert self.attention is not None
        need = self.attention.blocks_needed
        return [max(need[layer] for layer in layers) for layers in groups]

    def budget(self, groups: Sequence[Sequence[int]]) -> int:
        """csa_topk at the profile's block size: the neediest group's need (at least a block)."""
        return max(1, math.ceil(max(self.group_needs(groups))))

    def shares(self, groups: Sequence[Sequence[int]]) -> list[float]:
        """Each group's share of the budget, rounded up (a group's need is never cut)."""
        needs = self.group_needs(groups)
        if not max(needs):
            return [0.0] * len(needs)
        scale = 10**SHARE_DIGITS
        return [math.ceil(need / max(needs) * scale) / scale for need in needs]

    def reuses(self, groups: Sequence[Sequence[int]]) -> list[bool]:
        """Whether each group's choice persists enough, on its layers' mean, to be reused."""
        assert self.attention is not None
        overlap = self.attention.choice_overlap
        return [
            statistics.fmean(overlap[layer] for layer in layers) >= REUSE_OVERLAP
            for layers in groups
        ]

    def protected(self, groups: Sequence[Sequence[int]]) -> list[bool]:
        """Whether each dtype group's fp4 cost stands out (no sensitivity profile: none does)."""
        if self.sensitivity is None:
            return [False] * len(groups)
        median = statistics.median(self.sensitivity)
        cost = [statistics.fmean(self.sensitivity[layer] for layer in layers) for layers in groups]
        return [c > PROTECT_RATIO * median for c in cost]

    def channel_keys(self) -> bool:
        """Whether the median layer's keys have channel outliers."""
        return self.attention is not None and (
            statistics.median(self.attention.key_outlier) >= CHANNEL_OUTLIERS
        )


def _candidate(knobs: Mapping[str, Sequence[Any]], name: str, value: Any) -> dict[str, Any]:
    """{name: value} where value is a candidate of the knob, else nothing."""
    return {name: value} if value in knobs[name] else {}


def format_start(
    profiles: Profiles,
    groups: Sequence[Sequence[int]],
    dtypes: tuple[Sequence[str], Sequence[str]],
    knobs: Mapping[str, Sequence[Any]],
) -> tuple[list[tuple[str, str]], dict[str, Any]] | None:
    """(each dtype group's K/V pair, the knobs) of the 4-bit formats start, or None where the
    space has no 4-bit candidate for K or V."""
    four = [next((d for d in FOUR_BIT if d in candidates), None) for candidates in dtypes]
    if None in four:
        return None
    precise = tuple(most_precise_first(candidates)[0] for candidates in dtypes)
    layout = [precise if keep else tuple(four) for keep in profiles.protected(groups)]
    own = _candidate(knobs, "rotation", "hadamard")
    if profiles.channel_keys():
        own |= _candidate(knobs, "k_scale_axis", "channel")
    return layout, own  # type: ignore[return-value]


def selection_start(
    profiles: Profiles, groups: Sequence[Sequence[int]], knobs: Mapping[str, Sequence[Any]]
) -> dict[str, Any] | None:
    """The selection knobs of the selecting start (per-group params `<knob>_s<i>`), or None
    where the space cannot select at the profile's geometry."""
    attention = profiles.attention
    ratios = [r for r in knobs["csa_ratio"] if r > 1]
    if attention is None or not ratios or max(knobs["csa_topk"]) == 0:
        return None
    geometry = attention.geometry
    own = {
        "csa_ratio": min(ratios),
        "csa_window": geometry.window,
        "csa_sinks": geometry.sinks,
        "block_size": geometry.block_size,
        "csa_topk": profiles.budget(groups),
        **_candidate(knobs, "csa_summary", NO_SUMMARY),
        **_candidate(knobs, "csa_index_dtype", "int4"),
        # One staging pool the layers fill in turn: per-layer staging's answers (0.825 both on
        # the main job, RESULTS.md) at 0.16 of its device bytes.
        **_candidate(knobs, "csa_staging", "streamed"),
    }
    every = max(knobs["csa_select_every"])
    for index, (share, reuse) in enumerate(
        zip(profiles.shares(groups), profiles.reuses(groups), strict=True)
    ):
        own[f"csa_topk_share_s{index}"] = share
        own[f"csa_select_every_s{index}"] = every if reuse else 1
    return own
