"""The policy search space: knobs with candidates from conf/search, turned into Optuna params.

Every candidate is checked against the policy rules and the model before any trial runs, and
the pairings are checked statically (every chunk_size candidate a multiple of every block_size
candidate, every csa_ratio <= every block_size, every csa_window >= every block_size), so a
sampler can never draw an invalid combination and the space stays static (what TPE, GP and
grid need). K and V dtypes, and the share of the selection budget csa_topk that a layer reads
(PyramidKV-style budgets), are searched per layer group: groups come from the sensitivity
profile (kvtune/autotune/search/sensitivity.py), or one group a layer with `layer_groups: all`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution

from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES, ZERO_POINT_SCALE_DTYPES
from kvtune.kernels.formats.rotation import is_power_of_two
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES, most_precise_first
from kvtune.runtime.policy import (
    BLOCK_SIZES,
    CSA_INDEX_DTYPES,
    CSA_INDEXES,
    CSA_STAGINGS,
    CSA_SUMMARIES,
    INDEX_IN_LAYER_FORMAT,
    K_SCALE_AXES,
    KEEP_FRACTIONS,
    KEEP_GROUP,
    NO_ROTATION,
    NO_SUMMARY,
    PER_TENSOR,
    POOLED_INDEXES,
    ROTATION_NAMES,
    SCALE_DTYPES,
    ZERO_POINT_DTYPES,
    KVPolicy,
)

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
# Knobs drawn once per layer group (params "<knob>_g<i>"), beside the K and V dtypes: the
# selection budget and how long a choice is reused, since layers that retrieve want many
# blocks chosen at every query and layers that attend locally few, reused (stop 33).
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


def _can_keep(knobs: Mapping[str, Any]) -> bool:
    """Whether importance-kept blocks combine with the other knobs drawn (KVPolicy's rules):
    compression without selection, a window that holds a keep group, a recent region inside
    it. Elsewhere csa_keep falls back to 0, so every draw stays valid."""
    span = (KEEP_GROUP - 1) * knobs["block_size"]
    return (
        knobs["csa_ratio"] > 1
        and knobs["csa_topk"] == 0
        and knobs["csa_window"] >= span
        and knobs["recent_unquantized"] <= knobs["csa_window"] - span
    )


def _can_skip_summaries(knobs: Mapping[str, Any]) -> bool:
    """Whether a draw may drop the summaries (KVPolicy's rule): only selection on an index pool
    (key bounds or means) reads older blocks then. Elsewhere csa_summary falls back to the
    default pooling."""
    return knobs["csa_topk"] > 0 and knobs["csa_index"] in POOLED_INDEXES


def _can_scale_keys_per_channel(knobs: Mapping[str, Any]) -> bool:
    """Whether per-channel keys combine with the compression drawn (KVPolicy's rule): without
    compression, or without summaries and with key bounds in a separate index. Elsewhere
    k_scale_axis falls back to token."""
    if knobs["csa_ratio"] == 1:
        return True
    return knobs["csa_summary"] == NO_SUMMARY and knobs["csa_index_dtype"] != INDEX_IN_LAYER_FORMAT


def _fit_integer_scales(
    knobs: dict[str, Any], pairs: Sequence[str], candidates: Mapping[str, tuple[Any, ...]]
) -> None:
    """Integer formats keep a zero point per group in the scale (KVPolicy's rule): a draw that
    gives them a scale dtype without zero points (E4M3) takes the first candidate with them,
    and one that gives them a per-tensor group where they use it (values, token-scaled keys)
    takes the smallest group size candidate. So a space may list every dtype beside every
    scale setting and each draw stays valid (`SearchConfig` checks such candidates exist)."""
    keys = {pair.split("/")[0] for pair in pairs} & set(ZERO_POINT_DTYPES)
    values = {pair.split("/")[1] for pair in pairs} & set(ZERO_POINT_DTYPES)
    if (keys or values) and knobs["scale_dtype"] not in ZERO_POINT_SCALE_DTYPES:
        knobs["scale_dtype"] = next(
            s for s in candidates["scale_dtype"] if s in ZERO_POINT_SCALE_DTYPES
        )
    grouped = values or (keys and knobs["k_scale_axis"] == "token")
    if grouped and knobs["group_size"] == PER_TENSOR:
        knobs["group_size"] = min(g for g in candidates["group_size"] if g != PER_TENSOR)


def _candidates(name: str, value: object) -> tuple[Any, ...]:
    """A knob's candidates: a non-empty list without duplicates, or one scalar (fixed)."""
    listed = isinstance(value, Sequence) and not isinstance(value, str)
    values = tuple(value) if listed else (value,)
    if not values:
        raise ConfigError(_field(name), list(values), "a non-empty list of candidates")
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(_field(name), list(values), "candidates without duplicates")
    return values


def _check_each(name: str, values: tuple[Any, ...], ok: Any, allowed: str) -> None:
    for value in values:
        if not ok(value):
            raise ConfigError(_field(name), value, allowed)


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


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
            _check_each(name, dtypes, lambda d: d in KV_DTYPES, f"one of {', '.join(KV_DTYPES)}")
        groups = data["layer_groups"]
        if groups != ALL_LAYERS and not (_is_int(groups, 1) and groups <= arch.num_layers):
            raise ConfigError(
                _field("layer_groups"),
                groups,
                f'an integer in 1..{arch.num_layers} (the model\'s layers) or "{ALL_LAYERS}"',
            )
        config = cls(knobs, tuple(k_dtypes), tuple(v_dtypes), groups)
        config._check_knobs(arch)
        config._check_integer_pairings()
        return config

    def _check_integer_pairings(self) -> None:
        """Integer dtypes keep a zero point per group in the scale: a space listing them needs
        a scale dtype candidate with zero points and a group size candidate for draws to fall
        back to (`_fit_integer_scales`)."""
        k = self.knobs
        has_zero_point_scale = any(s in ZERO_POINT_SCALE_DTYPES for s in k["scale_dtype"])
        has_group = any(g != PER_TENSOR for g in k["group_size"])
        for name, dtypes in (("k_dtype", self.k_dtypes), ("v_dtype", self.v_dtypes)):
            integer = [d for d in dtypes if d in ZERO_POINT_DTYPES]
            if integer and not (has_zero_point_scale and has_group):
                raise ConfigError(
                    _field(name),
                    list(dtypes),
                    f"no {', '.join(integer)} unless scale_dtype lists one of "
                    f"{', '.join(ZERO_POINT_SCALE_DTYPES)} and group_size lists a size "
                    "(integer formats keep zero points in group scales)",
                )

    def _check_knobs(self, arch: ModelArch) -> None:
        k = self.knobs
        size = arch.cached_vector_size
        group_ok = [g for g in (8, 16, 32, 64, 128) if size % g == 0] + [PER_TENSOR]
        _check_each(
            "group_size",
            k["group_size"],
            lambda g: g == PER_TENSOR or (_is_int(g, 1) and size % g == 0),
            f"divisors of head_dim={size}: {', '.join(map(str, group_ok))}",
        )
        _check_each(
            "scale_dtype",
            k["scale_dtype"],
            SCALE_DTYPES.__contains__,
            f"one of {', '.join(SCALE_DTYPES)}",
        )
        _check_each(
            "k_scale_axis",
            k["k_scale_axis"],
            K_SCALE_AXES.__contains__,
            f"one of {', '.join(K_SCALE_AXES)}",
        )
        _check_each(
            "rotation",
            k["rotation"],
            lambda r: r in ROTATION_NAMES and (r == NO_ROTATION or is_power_of_two(size)),
            f"one of {', '.join(ROTATION_NAMES)} (hadamard needs a power-of-two head_dim, the "
            f"model's is {size})",
        )
        for name in ("recent_unquantized", "csa_sinks"):
            _check_each(name, k[name], lambda v: _is_int(v, 0), "integers >= 0 (tokens)")
        _check_each(
            "csa_topk", k["csa_topk"], lambda v: _is_int(v, 0), "integers >= 0 (blocks; 0 = none)"
        )
        _check_each(
            "csa_topk_share",
            k["csa_topk_share"],
            lambda s: isinstance(s, int | float) and not isinstance(s, bool) and 0 <= s <= 1,
            "numbers in [0, 1] (the share of csa_topk a layer group reads; 0 = none)",
        )
        _check_each(
            "csa_index",
            k["csa_index"],
            CSA_INDEXES.__contains__,
            f"one of {', '.join(CSA_INDEXES)}",
        )
        _check_each(
            "csa_index_dtype",
            k["csa_index_dtype"],
            CSA_INDEX_DTYPES.__contains__,
            f"one of {', '.join(CSA_INDEX_DTYPES)}",
        )
        _check_each(
            "csa_staging",
            k["csa_staging"],
            CSA_STAGINGS.__contains__,
            f"one of {', '.join(CSA_STAGINGS)}",
        )
        _check_each(
            "csa_select_every",
            k["csa_select_every"],
            lambda v: _is_int(v, 1),
            "integers >= 1 (positions a selection serves; 1 = every query selects)",
        )
        _check_each(
            "csa_keep",
            k["csa_keep"],
            lambda f: (
                isinstance(f, int | float) and not isinstance(f, bool) and f in KEEP_FRACTIONS
            ),
            f"values from {', '.join(f'{f:g}' for f in KEEP_FRACTIONS)}",
        )
        _check_each(
            "csa_summary",
            k["csa_summary"],
            CSA_SUMMARIES.__contains__,
            f"one of {', '.join(CSA_SUMMARIES)}",
        )
        _check_each(
            "block_size",
            k["block_size"],
            lambda b: _is_int(b, 1) and b in BLOCK_SIZES,
            f"values from {', '.join(map(str, BLOCK_SIZES))}",
        )
        smallest, largest = min(k["block_size"]), max(k["block_size"])
        _check_each(
            "csa_ratio",
            k["csa_ratio"],
            lambda r: _is_int(r, 1) and r & (r - 1) == 0 and r <= smallest,
            f"powers of two <= the smallest block_size candidate ({smallest})",
        )
        if max(k["csa_ratio"]) > 1:
            _check_each(
                "csa_window",
                k["csa_window"],
                lambda w: _is_int(w, largest),
                f"integers >= the largest block_size candidate ({largest}) when csa_ratio > 1",
            )
        else:
            _check_each("csa_window", k["csa_window"], lambda w: _is_int(w, 0), "integers >= 0")
        _check_each(
            "chunk_size",
            k["chunk_size"],
            lambda c: _is_int(c, 1) and c % largest == 0,
            f"multiples of every block_size candidate (of {largest}), so pages stay aligned",
        )

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

    groups: the layer indices of each group (group 0 the least fp4-sensitive when grouped by
        sensitivity; layer order with `all`).
    """

    config: SearchConfig
    groups: tuple[tuple[int, ...], ...]
    num_layers: int

    def distributions(self) -> dict[str, CategoricalDistribution]:
        """Every searched param (knobs with one candidate are fixed, not params)."""
        params: dict[str, CategoricalDistribution] = {}
        for name, choices in self.config.knobs.items():
            if len(choices) > 1 and name not in GROUP_KNOBS:
                params[name] = CategoricalDistribution(choices)
        per_group = {
            "k_dtype": self.config.k_dtypes,
            "v_dtype": self.config.v_dtypes,
            **{name: self.config.knobs[name] for name in GROUP_KNOBS},
        }
        for index in range(len(self.groups)):
            for name, choices in per_group.items():
                if len(choices) > 1:
                    params[f"{name}_g{index}"] = CategoricalDistribution(choices)
        return params

    def suggest(self, trial: optuna.Trial) -> KVPolicy:
        """Sample one policy (every draw is valid by construction)."""
        values = {
            name: trial.suggest_categorical(name, dist.choices)
            for name, dist in self.distributions().items()
        }
        return self.policy(values)

    def policy(self, params: Mapping[str, Any]) -> KVPolicy:
        """The canonical policy of a set of params (missing params take the fixed values)."""
        knobs = {name: params.get(name, choices[0]) for name, choices in self.config.knobs.items()}
        fixed_share = knobs.pop("csa_topk_share")  # not a policy field: drawn per group
        shares = [params.get(f"csa_topk_share_g{i}", fixed_share) for i in range(len(self.groups))]
        if knobs["csa_ratio"] == 1:
            knobs["csa_topk"] = 0  # nothing compressed, nothing to select
        budgets = [math.ceil(knobs["csa_topk"] * share) for share in shares]
        knobs["csa_topk"] = max(budgets)
        every = [  # a group that selects nothing reuses nothing
            params.get(f"csa_select_every_g{i}", knobs["csa_select_every"]) if budget else 1
            for i, budget in enumerate(budgets)
        ]
        knobs["csa_select_every"] = max(every)
        knobs["csa_host"] = knobs["csa_topk"] > 0  # selected blocks come from the host tier
        if not knobs["csa_host"]:
            knobs["csa_staging"] = _DEFAULTS.csa_staging  # only selection fetches into staging
        if not _can_keep(knobs):
            knobs["csa_keep"] = 0.0
        if knobs["csa_summary"] == NO_SUMMARY and not _can_skip_summaries(knobs):
            knobs["csa_summary"] = _DEFAULTS.csa_summary
        if not _can_skip_summaries(knobs):
            knobs["csa_index_dtype"] = INDEX_IN_LAYER_FORMAT  # only an index pool uses it
        if not _can_scale_keys_per_channel(knobs):
            knobs["k_scale_axis"] = "token"  # channel scales need whole blocks, not summaries
        pairs = [""] * self.num_layers
        layer_topk = [0] * self.num_layers
        layer_every = [1] * self.num_layers
        for index, layers in enumerate(self.groups):
            k = params.get(f"k_dtype_g{index}", self.config.k_dtypes[0])
            v = params.get(f"v_dtype_g{index}", self.config.v_dtypes[0])
            for layer in layers:
                pairs[layer] = f"{k}/{v}"
                layer_topk[layer] = budgets[index]
                layer_every[layer] = every[index]
        _fit_integer_scales(knobs, pairs, self.config.knobs)
        if knobs["csa_topk"]:
            knobs["layer_csa_topk"] = tuple(layer_topk)
            knobs["layer_csa_select_every"] = tuple(layer_every)
        return canonical(KVPolicy.from_dict(knobs).replace(layer_dtypes=tuple(pairs)))

    def warm_starts(self) -> dict[str, dict[str, Any]]:
        """Params of the standard starting points that this space can express.

        baseline: the most precise dtype everywhere, no compression; all-fp8; fp4 in the
        shallow half of the layers (by group mean depth) with fp8 in the deep half; K fp8 with
        V fp4; int4 with per-channel keys over 32-token blocks, values in groups of 64, both
        Hadamard-rotated (0.30 of fp16's bytes; benchmarks/formats.py); fp8 with a 256-token window
        and 48 older blocks a query selected from the host tier, no summaries (Quest; 0.21 of
        fp16's device bytes at 3K tokens, benchmarks/compression.py); the same selection at 80
        blocks over 4-bit codes, per-channel keys beside an int4 key-bounds index (0.18 of
        fp16's device bytes at 3K tokens; 0.96 held out there). Other knobs take the
        KVPolicy default where it is a candidate, else the first; a start whose own knob values
        are not candidates is left out.
        """
        distributions = self.distributions()
        fixed = {
            name: (_default(name) if _default(name) in choices else choices[0])
            for name, choices in self.config.knobs.items()
        }
        fixed["csa_ratio"] = min(self.config.knobs["csa_ratio"])
        fixed["recent_unquantized"] = min(self.config.knobs["recent_unquantized"])
        depth = [sum(layers) / len(layers) for layers in self.groups]
        median_depth = sorted(depth)[len(depth) // 2] if len(depth) > 1 else math.inf
        precise = tuple(
            most_precise_first(d)[0] for d in (self.config.k_dtypes, self.config.v_dtypes)
        )
        layouts = {
            "baseline": [precise] * len(self.groups),
            "all-fp8": [("fp8", "fp8")] * len(self.groups),
            "fp4-shallow-fp8-deep": [
                ("fp4", "fp4") if d < median_depth else ("fp8", "fp8") for d in depth
            ],
            "k-fp8-v-fp4": [("fp8", "fp4")] * len(self.groups),
            "int4-k-channel-rotated": [("int4", "int4")] * len(self.groups),
            "fp8-w256-top48-host-no-summaries": [("fp8", "fp8")] * len(self.groups),
            "int4-k-channel-w256-top80-host-int4-index": [("int4", "int4")] * len(self.groups),
            "int4-k-channel-w256-top80-streamed-int4-index": [("int4", "int4")] * len(self.groups),
        }
        own_knobs = {
            "int4-k-channel-rotated": {
                "k_scale_axis": "channel",
                "rotation": "hadamard",
                "group_size": 64,
                "block_size": 32,
            },
            "fp8-w256-top48-host-no-summaries": {
                "csa_ratio": 2,
                "csa_window": 256,
                "csa_topk": 48,
                "csa_summary": NO_SUMMARY,
            },
            "int4-k-channel-w256-top80-host-int4-index": {
                "k_scale_axis": "channel",
                "rotation": "hadamard",
                "group_size": 64,
                "block_size": 16,
                "csa_ratio": 2,
                "csa_window": 256,
                "csa_topk": 80,
                "csa_summary": NO_SUMMARY,
                "csa_index_dtype": "int4",
            },
        }
        # The same selection with one staging pool the layers share: about a third of the
        # device bytes, every layer's choice fetched every step.
        own_knobs["int4-k-channel-w256-top80-streamed-int4-index"] = {
            **own_knobs["int4-k-channel-w256-top80-host-int4-index"],
            "csa_staging": "streamed",
        }
        starts = {}
        for name, layout in layouts.items():
            knobs = own_knobs.get(name, {})
            if any(value not in self.config.knobs[knob] for knob, value in knobs.items()):
                continue
            params = {**fixed, **knobs}
            for index, (k, v) in enumerate(layout):
                params[f"k_dtype_g{index}"] = k
                params[f"v_dtype_g{index}"] = v
                params.update({f"{name}_g{index}": params[name] for name in GROUP_KNOBS})
            expressible = {p: value for p, value in params.items() if p in distributions}
            if all(value in distributions[p].choices for p, value in expressible.items()):
                starts[name] = expressible
        return starts


def canonical(policy: KVPolicy) -> KVPolicy:
    """One representative of policies that store and compute the same cache.

    Scale settings, the rotation and the unquantized recent window mean nothing without a
    quantized stream
    (the group size becomes "tensor", the one value every head_dim accepts), the key scale axis
    nothing without a quantized key stream, the CSA window, sinks, summary pooling and
    selection nothing without compression (the selection index nothing without selection,
    the pooling ratio nothing without summaries), and
    per-layer pairs, or per-layer selection budgets, that are all equal are the plain fields.
    Canonical policies make equal trials hit the same cache entry.
    """
    pairs = policy.layer_dtypes or (f"{policy.k_dtype}/{policy.v_dtype}",)
    changes: dict[str, Any] = {}
    if len(set(pairs)) == 1:
        k, v = pairs[0].split("/")
        changes.update(k_dtype=k, v_dtype=v, layer_dtypes=None)
    else:
        changes.update(k_dtype=_DEFAULTS.k_dtype, v_dtype=_DEFAULTS.v_dtype)
    if not any(d in QUANTIZED_DTYPES for pair in pairs for d in pair.split("/")):
        changes.update(
            group_size=PER_TENSOR,
            scale_dtype=_DEFAULTS.scale_dtype,
            recent_unquantized=_DEFAULTS.recent_unquantized,
            rotation=NO_ROTATION,
        )
    keys_quantized = any(pair.split("/")[0] in QUANTIZED_DTYPES for pair in pairs)
    values_quantized = any(pair.split("/")[1] in QUANTIZED_DTYPES for pair in pairs)
    if not keys_quantized:
        changes.update(k_scale_axis=_DEFAULTS.k_scale_axis)
    elif policy.k_scale_axis == "channel" and not values_quantized:
        changes.update(group_size=PER_TENSOR)  # channel keys ignore it, no value uses it
    if policy.layer_csa_topk is not None and len(set(policy.layer_csa_topk)) == 1:
        changes.update(layer_csa_topk=None)
    if policy.layer_csa_select_every is not None and len(set(policy.layer_csa_select_every)) == 1:
        changes.update(layer_csa_select_every=None)
    if not policy.compressed:
        changes.update(
            csa_window=_DEFAULTS.csa_window,
            csa_sinks=_DEFAULTS.csa_sinks,
            csa_summary=_DEFAULTS.csa_summary,
            csa_topk=0,
            layer_csa_topk=None,
            csa_host=False,
            csa_keep=0.0,
        )
    if not policy.selects:
        changes.update(
            csa_index=_DEFAULTS.csa_index,
            csa_staging=_DEFAULTS.csa_staging,
            csa_select_every=1,
            layer_csa_select_every=None,
        )
    if not policy.pooled_index:
        changes.update(csa_index_dtype=INDEX_IN_LAYER_FORMAT)
    if policy.compressed and not policy.summarises:
        changes.update(csa_ratio=2)  # nothing is pooled: every ratio is the same policy
    return policy.replace(**changes)
