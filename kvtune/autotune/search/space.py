"""The policy search space: knobs with candidates from conf/search, turned into Optuna params.

Every candidate is checked by the policy's own field checks and the model before any trial runs,
and the policy rules a draw cannot fall back on (chunk_size and csa_ratio against block_size,
csa_window against block_size; kvtune/runtime/policy/rules.py) hold for every combination of
candidates; a draw that breaks any other rule gives way to it, knob by knob. So a sampler can
never draw an invalid combination and the space stays static (what TPE, GP and grid need). K and
V dtypes, and the share of the selection budget csa_topk that a layer reads (PyramidKV-style
budgets), are searched per layer group: groups come from the sensitivity profile
(kvtune/autotune/search/sensitivity.py), or one group a layer with `layer_groups: all`.
"""

from __future__ import annotations

import itertools
import math
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution

from kvtune.autotune.search.attention_profile import Geometry
from kvtune.autotune.search.profiles import Profiles, format_start, selection_start
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import most_precise_first
from kvtune.runtime.policy import PER_TENSOR, KVPolicy, canonical, rules
from kvtune.runtime.policy.rules import Rule
from kvtune.runtime.policy.storage import check_group_size, check_rotation

ALL_LAYERS = "all"
KNOB_NAMES = (
    "group_size",
    "scale_dtype",
    "k_scale_axis",
    "rotation",
    "recent_unquantized",
    "csa_ratio",
    "csa_window",
    "csa_sinks",
    "csa_summary",
    "csa_topk",
    "csa_topk_share",
    "csa_index",
    "csa_index_dtype",
    "csa_staging",
    "csa_select_every",
    "csa_keep",
    "block_size",
    "chunk_size",
)
_DEFAULTS = KVPolicy()
# Knobs drawn once per selection group (params "<knob>_s<i>"): the selection budget and how
# long a choice is reused, since layers that retrieve want many blocks chosen at every query and
# layers that attend locally few, reused (benchmarks/RESULTS.md, "CSA pooling and selection").
# The K and V dtypes are drawn once per dtype group ("k_dtype_g<i>").
GROUP_KNOBS = ("csa_topk_share", "csa_select_every")
# Knobs of the space that are not policy fields, with the value a conf/search without them
# keeps: each layer group reads csa_topk * share blocks (rounded up; 0: none).
SPACE_DEFAULTS: dict[str, Any] = {"csa_topk_share": 1.0}


def _default(name: str) -> Any:
    """A knob's value where a space leaves it out: the space's own default, else the
    policy's."""
    return SPACE_DEFAULTS[name] if name in SPACE_DEFAULTS else getattr(_DEFAULTS, name)


# Knobs added after studies began: a conf/search without them keeps the policy default.
OPTIONAL_KNOBS = (
    "k_scale_axis",
    "rotation",
    "csa_summary",
    "csa_topk",
    "csa_topk_share",
    "csa_index",
    "csa_index_dtype",
    "csa_staging",
    "csa_select_every",
    "csa_keep",
)


def _field(name: str) -> str:
    return f"search.{name}"


# Rules between knobs that no draw falls back on: they hold for every combination of the
# candidates they read, checked when the space is loaded.
STATIC_RULES = (
    rules.CHUNKS_ALIGN_WITH_BLOCKS,
    rules.RATIO_FITS_A_BLOCK,
    rules.WINDOW_HOLDS_A_BLOCK,
)
# The scale knobs a draw's formats may need another candidate of, with the rules they keep.
FORMAT_FALLBACKS: dict[str, tuple[Rule, ...]] = {
    "scale_dtype": (rules.ZERO_POINTS_NEED_THEIR_SCALE_DTYPE,),
    "group_size": rules.GROUP_RULES,
}


def _keeps(fields: Mapping[str, Any], knob_rules: Iterable[Rule]) -> bool:
    return all(rule.holds(fields) for rule in knob_rules)


def _fall_back(
    fields: ChainMap[str, Any], name: str, fallbacks: Iterable[Any], knob_rules: Sequence[Rule]
) -> None:
    """Where a draw breaks one of `knob_rules`, knob `name` takes the first of `fallbacks`
    that keeps them all (SearchConfig makes sure one does), so every draw stays valid."""
    if not _keeps(fields, knob_rules):
        fields[name] = next(v for v in fallbacks if _keeps(fields.new_child({name: v}), knob_rules))


def _candidates(name: str, value: object) -> tuple[Any, ...]:
    """A knob's candidates: a non-empty list without duplicates, or one scalar (fixed)."""
    listed = isinstance(value, Sequence) and not isinstance(value, str)
    values = tuple(value) if listed else (value,)
    if not values:
        raise ConfigError(_field(name), list(values), "a non-empty list of candidates")
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(_field(name), list(values), "candidates without duplicates")
    return values


def _check_each(name: str, values: tuple[Any, ...], check: Callable[[Any], object]) -> None:
    """Each candidate through a policy check, refused under the space's knob name."""
    for value in values:
        try:
            check(value)
        except ConfigError as error:
            raise ConfigError(_field(name), value, error.allowed) from None


def _as_the_policy_writes(name: str, value: Any) -> None:
    """A candidate the policy field accepts as it is (the space draws it as written)."""
    checked = KVPolicy.checked_field(name, value)
    if checked != value:
        raise ConfigError(_field(name), value, f"{checked!r}, as the policy writes it")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_share(share: object) -> None:
    """csa_topk_share, the space's own knob: the share of csa_topk a layer group reads."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
        raise ConfigError(
            _field("csa_topk_share"),
            share,
            "a number in [0, 1] (the share of csa_topk a layer group reads; 0 = none)",
        )


@dataclass(frozen=True)
class SearchConfig:
    """Validated knobs of conf/search (cheap: no profiling, no model weights).

    knobs: candidates of every scalar policy field, in KNOB_NAMES order.
    k_dtypes, v_dtypes: candidates of each layer group's K and V dtype.
    layer_groups: number of sensitivity groups, or "all" (one group a layer).
    """

    knobs: dict[str, tuple[Any, ...]]
    k_dtypes: tuple[str, ...]
    v_dtypes: tuple[str, ...]
    layer_groups: int | str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], arch: ModelArch) -> SearchConfig:
        known = {*KNOB_NAMES, "k_dtype", "v_dtype", "layer_groups"}
        for key in data:
            if key not in known:
                raise ConfigError(
                    _field(str(key)), data[key], f"unknown knob; known: {', '.join(sorted(known))}"
                )
        data = {**{name: _default(name) for name in OPTIONAL_KNOBS}, **data}
        for key in known:
            if key not in data:
                raise ConfigError(_field(key), None, "candidates (missing from conf/search)")
        knobs = {name: _candidates(name, data[name]) for name in KNOB_NAMES}
        k_dtypes = _candidates("k_dtype", data["k_dtype"])
        v_dtypes = _candidates("v_dtype", data["v_dtype"])
        for name, dtypes in (("k_dtype", k_dtypes), ("v_dtype", v_dtypes)):
            _check_each(name, dtypes, lambda d, name=name: _as_the_policy_writes(name, d))
        groups = data["layer_groups"]
        if groups != ALL_LAYERS and not (_is_int(groups, 1) and groups <= arch.num_layers):
            raise ConfigError(
                _field("layer_groups"),
                groups,
                f'an integer in 1..{arch.num_layers} (the model\'s layers) or "{ALL_LAYERS}"',
            )
        config = cls(knobs, tuple(k_dtypes), tuple(v_dtypes), groups)
        config._check_knobs(arch)
        config._check_fallbacks()
        return config

    def _check_knobs(self, arch: ModelArch) -> None:
        """Each candidate as the policy checks its field, group sizes and rotations as the model
        checks them; then the static rules over every combination of candidates."""
        for name, candidates in self.knobs.items():
            if name not in SPACE_DEFAULTS:  # a policy field
                _check_each(name, candidates, lambda v, name=name: _as_the_policy_writes(name, v))
        for share in self.knobs["csa_topk_share"]:
            _check_share(share)
        _check_each(
            "group_size",
            self.knobs["group_size"],
            lambda g: check_group_size("group_size", g, arch),
        )
        _check_each("rotation", self.knobs["rotation"], lambda r: check_rotation(r, arch))
        for rule in STATIC_RULES:
            for combination in itertools.product(*(self.knobs[name] for name in rule.reads)):
                fields = dict(zip(rule.reads, combination, strict=True))
                if not rule.holds(fields):
                    raise rule.error(fields, section="search")

    def _check_fallbacks(self) -> None:
        """A draw whose formats break a scale rule takes another scale_dtype or group_size
        candidate (`SearchSpace.policy`): each K and V dtype candidate needs one that it
        allows."""
        for name, dtypes in (("k_dtype", self.k_dtypes), ("v_dtype", self.v_dtypes)):
            for dtype, (knob, knob_rules) in itertools.product(dtypes, FORMAT_FALLBACKS.items()):
                drawn = [
                    ChainMap({name: dtype, knob: candidate}, vars(_DEFAULTS))
                    for candidate in self.knobs[knob]
                ]
                if not any(_keeps(fields, knob_rules) for fields in drawn):
                    broken = next(rule for rule in knob_rules if not rule.holds(drawn[0]))
                    raise ConfigError(
                        _field(name),
                        list(dtypes),
                        f"no {dtype} unless {knob} lists a candidate it allows: "
                        f"{broken.error(drawn[0]).allowed}",
                    )

    @property
    def selects(self) -> bool:
        """Whether some draw selects older blocks (compression and a budget among candidates)."""
        return max(self.knobs["csa_topk"]) > 0 and max(self.knobs["csa_ratio"]) > 1

    def profile_geometry(self, context: int) -> Geometry:
        """Where the attention profile measures: the smallest window, and the sinks and block
        size a draw takes by default."""

        def usual(name: str) -> int:
            default = _default(name)
            return default if default in self.knobs[name] else min(self.knobs[name])

        window = min(self.knobs["csa_window"])
        return Geometry(context, usual("csa_sinks"), window, usual("block_size"))

    @property
    def needs_sensitivity(self) -> bool:
        """Whether layer grouping needs the measured profile (1 group or `all` do not)."""
        return self.layer_groups != ALL_LAYERS and self.layer_groups > 1

    def num_groups(self, num_layers: int) -> int:
        return num_layers if self.layer_groups == ALL_LAYERS else int(self.layer_groups)

    def size(self, num_groups: int) -> int:
        """Combinations in the space (what a grid would enumerate)."""
        scalars = math.prod(len(c) for name, c in self.knobs.items() if name not in GROUP_KNOBS)
        per_group = len(self.k_dtypes) * len(self.v_dtypes)
        per_group *= math.prod(len(self.knobs[name]) for name in GROUP_KNOBS)
        return scalars * per_group**num_groups


@dataclass(frozen=True)
class SearchSpace:
    """A SearchConfig with its layer groups resolved: what a trial samples.

    groups: the layer indices of each dtype group (group 0 the least fp4-sensitive when grouped
        by sensitivity; layer order with `all`).
    profiles: the measured profiles; with an attention profile the budget knobs are drawn per
        selection group (layers grouped by the older blocks they need), each group's share
        and csa_topk gain the profile's own candidates, and the warm starts derive from them.
    """

    config: SearchConfig
    groups: tuple[tuple[int, ...], ...]
    num_layers: int
    profiles: Profiles = Profiles()

    @cached_property
    def selection_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.profiles.selection_groups(len(self.groups), self.num_layers) or self.groups

    @cached_property
    def knobs(self) -> dict[str, tuple[Any, ...]]:
        """The config's candidates, csa_topk with the profile's budget where the space selects."""
        knobs = dict(self.config.knobs)
        if self.profiles.attention is not None and self.config.selects:
            budget = self.profiles.budget(self.selection_groups)
            knobs["csa_topk"] = tuple(sorted({*knobs["csa_topk"], budget}))
        return knobs

    def _group_choices(self) -> dict[str, tuple[Any, ...]]:
        """Every per-group param with its candidates."""
        params = {}
        for index in range(len(self.groups)):
            params[f"k_dtype_g{index}"] = self.config.k_dtypes
            params[f"v_dtype_g{index}"] = self.config.v_dtypes
        shares = self.knobs["csa_topk_share"]
        measured = (
            self.profiles.shares(self.selection_groups)
            if self.profiles.attention is not None and self.config.selects
            else [None] * len(self.selection_groups)
        )
        for index, share in enumerate(measured):
            choices = shares if share is None else tuple(sorted({*shares, share}))
            params[f"csa_topk_share_s{index}"] = choices
            params[f"csa_select_every_s{index}"] = self.knobs["csa_select_every"]
        return params

    def distributions(self) -> dict[str, CategoricalDistribution]:
        """Every searched param (knobs with one candidate are fixed, not params)."""
        params = {
            name: CategoricalDistribution(choices)
            for name, choices in self.knobs.items()
            if len(choices) > 1 and name not in GROUP_KNOBS
        }
        for name, choices in self._group_choices().items():
            if len(choices) > 1:
                params[name] = CategoricalDistribution(choices)
        return params

    def suggest(self, trial: optuna.Trial) -> KVPolicy:
        """Sample one policy (every draw is valid by construction)."""
        values = {
            name: trial.suggest_categorical(name, dist.choices)
            for name, dist in self.distributions().items()
        }
        return self.policy(values)

    def policy(self, params: Mapping[str, Any]) -> KVPolicy:
        """The canonical policy of a set of params (missing params take the fixed values).

        Where the draw breaks a policy rule, a knob gives way: to its policy default (csa_host to
        true, where selection needs the host tier), or, for a format's scales, to the first
        scale_dtype and the smallest group_size candidate that keep the rule. Each rule reads
        the knobs settled before it."""
        knobs = {name: params.get(name, choices[0]) for name, choices in self.knobs.items()}
        fixed_share = knobs.pop("csa_topk_share")  # not a policy field: drawn per group
        groups = self.selection_groups
        shares = [params.get(f"csa_topk_share_s{i}", fixed_share) for i in range(len(groups))]
        fields = ChainMap(knobs, vars(_DEFAULTS))  # what the rules read: the draw, else defaults
        _fall_back(fields, "csa_topk", [_DEFAULTS.csa_topk], [rules.SELECTION_NEEDS_COMPRESSION])
        budgets = [math.ceil(knobs["csa_topk"] * share) for share in shares]
        knobs["csa_topk"] = max(budgets)
        every = [  # a group that selects nothing reuses nothing
            params.get(f"csa_select_every_s{i}", knobs["csa_select_every"]) if budget else 1
            for i, budget in enumerate(budgets)
        ]
        knobs["csa_select_every"] = max(every)
        _fall_back(fields, "csa_host", [True], [rules.SELECTION_NEEDS_THE_HOST_TIER])
        for name, knob_rules in (
            ("csa_staging", [rules.STREAMED_STAGING_NEEDS_SELECTION]),
            ("csa_keep", rules.KEEP_RULES),
            ("csa_summary", [rules.NO_SUMMARIES_NEED_AN_INDEX_POOL]),
            ("csa_index_dtype", [rules.INDEX_DTYPE_NEEDS_AN_INDEX_POOL]),
            ("k_scale_axis", [rules.CHANNEL_KEYS_NEED_WHOLE_BLOCKS]),
        ):
            _fall_back(fields, name, [getattr(_DEFAULTS, name)], knob_rules)
        pairs = [""] * self.num_layers
        for index, layers in enumerate(self.groups):
            k = params.get(f"k_dtype_g{index}", self.config.k_dtypes[0])
            v = params.get(f"v_dtype_g{index}", self.config.v_dtypes[0])
            for layer in layers:
                pairs[layer] = f"{k}/{v}"
        layer_topk = [0] * self.num_layers
        layer_every = [1] * self.num_layers
        for index, layers in enumerate(groups):
            for layer in layers:
                layer_topk[layer] = budgets[index]
                layer_every[layer] = every[index]
        knobs["layer_dtypes"] = tuple(pairs)
        scales = self.knobs["scale_dtype"]
        group_sizes = sorted(g for g in self.knobs["group_size"] if g != PER_TENSOR)
        _fall_back(fields, "scale_dtype", scales, FORMAT_FALLBACKS["scale_dtype"])
        _fall_back(fields, "group_size", group_sizes, FORMAT_FALLBACKS["group_size"])
        if knobs["csa_topk"]:
            knobs["layer_csa_topk"] = tuple(layer_topk)
            knobs["layer_csa_select_every"] = tuple(layer_every)
        return canonical(KVPolicy.from_dict(knobs))

    def warm_starts(self) -> dict[str, dict[str, Any]]:
        """Params of the starting points that this space can express, derived from its profiles
        (profiles.py), none typed in: the baseline (the most precise dtype everywhere, no
        compression); `profile-formats`, 4-bit codes except in dtype groups whose fp4 cost
        stands out; `profile-selecting`, those formats with selection at the attention
        profile's budgets and reuse, staged in one pool the layers share where the space offers
        `streamed` (profiles.selection_start). Other knobs take the space's default where it is
        a candidate, else the first (csa_ratio and recent_unquantized their smallest); a start
        whose own knobs are not all candidates is left out."""
        fixed = {
            name: (_default(name) if _default(name) in choices else choices[0])
            for name, choices in self.knobs.items()
        }
        fixed["csa_ratio"] = min(self.knobs["csa_ratio"])
        fixed["recent_unquantized"] = min(self.knobs["recent_unquantized"])
        dtypes = (self.config.k_dtypes, self.config.v_dtypes)
        precise = tuple(most_precise_first(candidates)[0] for candidates in dtypes)
        layouts: dict[str, tuple[list[Any], dict[str, Any]]] = {
            "baseline": ([precise] * len(self.groups), {})
        }
        formats = format_start(self.profiles, self.groups, dtypes, self.knobs)
        if formats is not None:
            layouts["profile-formats"] = formats
            selecting = selection_start(self.profiles, self.selection_groups, self.knobs)
            if selecting is not None:
                layouts["profile-selecting"] = (formats[0], {**formats[1], **selecting})
        choices = {**self.knobs, **self._group_choices()}
        distributions = self.distributions()
        starts = {}
        for name, (layout, own) in layouts.items():
            if any(value not in choices[knob] for knob, value in own.items()):
                continue
            params = {**fixed, **own}
            for index, (k, v) in enumerate(layout):
                params[f"k_dtype_g{index}"] = k
                params[f"v_dtype_g{index}"] = v
            for index in range(len(self.selection_groups)):
                for knob in GROUP_KNOBS:
                    params.setdefault(f"{knob}_s{index}", fixed[knob])
            starts[name] = {p: value for p, value in params.items() if p in distributions}
        return starts
