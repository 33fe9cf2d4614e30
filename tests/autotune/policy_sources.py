"""Every KV policy the tuner draws or is given, listed from where each kind is defined.

A source is one policy with a name that says where it came from, so a failing test names it:
- draws: seeded random draws from each space in conf/search/ (the folder is listed), each a set
  of the space's Optuna params, as any sampler may pick them (any combination of candidates);
- warm starts: `SearchSpace.warm_starts()` of each space;
- presets: conf/policy/default.yaml and every engine preset (`engine_presets`);
- formats: one policy per dtype that the policy accepts (`KV_DTYPES`) or the format registry
  lists as a cache choice (`ELEMENT_FORMATS`), on K and on V, with the group size and scale
  dtype its registry record asks for, so a format no space draws (int2, bf16, lloyd2, the next
  one) is covered.

Layer groups come from a sensitivity profile, which needs a model run; here a space's groups are
contiguous runs of layers, as many as the space asks for. The grouping moves a draw's dtypes to
other layers; which draws are valid does not depend on it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtune.autotune.config.engine_presets import engine_presets, preset_names
from kvtune.autotune.config.settings import build_model_arch
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.optuna_study import ENGINE_PRESET_ATTR, WARM_START_ATTR, policy_key
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES
from kvtune.runtime.policy import KVPolicy

CONF = Path(__file__).resolve().parents[2] / "conf"
SEARCH_DIR = CONF / "search"
MODEL = "smollm2-135m"
ARCH = build_model_arch(yaml.safe_load((CONF / "model" / f"{MODEL}.yaml").read_text()))
DRAWS_PER_SPACE = 200
# Draws tried per space before giving up on DRAWS_PER_SPACE distinct policies.
MAX_ATTEMPTS = 10 * DRAWS_PER_SPACE
SEED = 0
PRESETS_GROUP = "presets"
FORMATS_GROUP = "formats"
DEFAULT_SEARCH = "default"
_DEFAULT = KVPolicy()


@dataclass(frozen=True)
class PolicySource:
    """One policy and where it comes from.

    id: "<group>/<name>", the test id. group: the study that records it (one a space, one for
        the presets, one for the formats); search: the conf/search space of that study's recipe.
    build: makes the policy (the policy's validation runs here, inside the test).
    user_attrs: what the study stores about its origin (warm_start, engine_preset).
    """

    id: str
    group: str
    search: str
    build: Callable[[], KVPolicy]
    user_attrs: dict[str, Any] = field(default_factory=dict)


def space_names() -> list[str]:
    """Every search space in conf/search/."""
    return sorted(path.stem for path in SEARCH_DIR.glob("*.yaml"))


def contiguous_groups(count: int, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """count runs of consecutive layers, of near-equal size, in layer order."""
    return tuple(
        tuple(range(i * num_layers // count, (i + 1) * num_layers // count)) for i in range(count)
    )


def search_space(name: str) -> SearchSpace:
    """conf/search/<name>.yaml on the embedded model, grouped by contiguous_groups."""
    config = SearchConfig.from_dict(yaml.safe_load((SEARCH_DIR / f"{name}.yaml").read_text()), ARCH)
    groups = contiguous_groups(config.num_groups(ARCH.num_layers), ARCH.num_layers)
    return SearchSpace(config, groups, ARCH.num_layers)


def _key(space: SearchSpace, params: dict[str, Any]) -> str | None:
    """The policy's identity, or None where the space refuses its own draw (its test then
    raises the error)."""
    try:
        return policy_key(space.policy(params))
    except ConfigError:
        return None


def space_sources(name: str) -> list[PolicySource]:
    """A space's warm starts, then DRAWS_PER_SPACE seeded draws of distinct policies (a study
    prunes a policy it has measured, so a draw equal to an earlier source is drawn again)."""
    space = search_space(name)
    group = f"space-{name}"
    distributions = space.distributions()
    sources, seen = [], set()
    for start, params in space.warm_starts().items():
        seen.add(_key(space, params))
        sources.append(
            PolicySource(
                f"{group}/warm-{start}",
                group,
                name,
                lambda params=params: space.policy(params),
                {WARM_START_ATTR: start},
            )
        )
    rng = random.Random(f"{SEED}-{name}")
    draws = 0
    for _ in range(MAX_ATTEMPTS):
        params = {p: rng.choice(d.choices) for p, d in distributions.items()}
        key = _key(space, params)
        if key is not None and key in seen:
            continue
        seen.add(key)
        sources.append(
            PolicySource(
                f"{group}/draw-{draws:03d}",
                group,
                name,
                lambda params=params: space.policy(params),
            )
        )
        draws += 1
        if draws == DRAWS_PER_SPACE:
            return sources
    raise AssertionError(f"{name}: fewer than {DRAWS_PER_SPACE} distinct policies drawn")


def preset_sources() -> list[PolicySource]:
    """conf/policy/default.yaml, then every engine preset (queued as a study queues them)."""
    default_yaml = (CONF / "policy" / "default.yaml").read_text()
    sources = [
        PolicySource(
            f"{PRESETS_GROUP}/default",
            PRESETS_GROUP,
            DEFAULT_SEARCH,
            lambda: KVPolicy.from_yaml(default_yaml),
        )
    ]
    for name in preset_names():
        sources.append(
            PolicySource(
                f"{PRESETS_GROUP}/{name}",
                PRESETS_GROUP,
                DEFAULT_SEARCH,
                lambda name=name: engine_presets(ARCH.cached_vector_size)[name],
                user_attrs={ENGINE_PRESET_ATTR: name, WARM_START_ATTR: name},
            )
        )
    return sources


def format_dtypes() -> list[str]:
    """Every dtype the policy accepts and every registered element format a policy may name
    (read when called, so a format added to the registry is listed; fp32 is registered only as
    what `auto` stores for an fp32 model)."""
    choices = [name for name, element in ELEMENT_FORMATS.items() if element.cache_choice]
    return list(dict.fromkeys([*KV_DTYPES, *choices]))


def format_fields(dtype: str, stream: str) -> dict[str, Any]:
    """Policy fields putting dtype on one stream ("K" or "V"), the other at the default; a
    registered format gets the group size its record asks for (a whole vector, or the default
    group) and its own scale dtype where it has one."""
    fields: dict[str, Any] = {"k_dtype" if stream == "K" else "v_dtype": dtype}
    element = ELEMENT_FORMATS.get(dtype)
    if element is not None:
        fields["group_size"] = ARCH.cached_vector_size if element.whole_vector else None
        fields["scale_dtype"] = element.scale_dtype
    return {name: value for name, value in fields.items() if value is not None}


def format_sources() -> list[PolicySource]:
    """One policy per format on K and on V (fp16 on K is fp16 on V: listed once)."""
    sources, seen = [], []
    for dtype in format_dtypes():
        for stream in ("K", "V"):
            fields = format_fields(dtype, stream)
            complete = {**_DEFAULT.to_dict(), **fields}
            if complete in seen:
                continue
            seen.append(complete)
            sources.append(
                PolicySource(
                    f"{FORMATS_GROUP}/{stream}={dtype}",
                    FORMATS_GROUP,
                    DEFAULT_SEARCH,
                    lambda fields=fields: KVPolicy.from_dict(fields),
                )
            )
    return sources


def all_sources() -> list[PolicySource]:
    """Every source, grouped by study."""
    spaces = [source for name in space_names() for source in space_sources(name)]
    return [*spaces, *preset_sources(), *format_sources()]
