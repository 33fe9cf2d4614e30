"""A study's recipe: the composed config that defines it, validated into ready objects.

`kvtune tune` stores the recipe in the Optuna study, so a worker on another machine, a resumed
run and `kvtune export` rebuild exactly the same model, workload, search space, suite and
objectives from the storage alone. Everything here is cheap and runs before any model weights
are read: a bad value fails with one ConfigError line naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvtune.autotune.cache import JsonCache
from kvtune.autotune.config.settings import (
    DeviceSpec,
    ServeSettings,
    build_device,
    build_model_arch,
)
from kvtune.autotune.config.workload import Workload
from kvtune.autotune.search.attention_profile import attention_profile
from kvtune.autotune.search.profiles import Profiles
from kvtune.autotune.search.sensitivity import RuntimeSettings, group_layers, layer_sensitivity
from kvtune.autotune.search.space import ALL_LAYERS, SearchConfig, SearchSpace
from kvtune.autotune.study.objectives import (
    Constraints,
    TrialContext,
    TrialEvaluator,
    parse_objectives,
)
from kvtune.autotune.study.screening import Screen, ScreenSettings
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.backends import BACKENDS
from kvtune.runtime.dtypes import compute_dtype_name
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.model_source import resolve_model

RECIPE_KEYS = (
    "model",
    "arch",
    "device",
    "serve",
    "workload",
    "search",
    "eval",
    "objectives",
    "constraints",
    "runtime",
)


def plain(node: Any) -> Any:
    """Plain Python containers from OmegaConf nodes (JSON-serializable)."""
    if isinstance(node, DictConfig) or OmegaConf.is_list(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def recipe_from_config(cfg: DictConfig, command_line: Iterable[str]) -> dict[str, Any]:
    """The recipe of `kvtune tune`'s composed config (the model's arch resolved once, here)."""
    for key in RECIPE_KEYS:
        if key not in ("arch", "eval") and key not in cfg:
            raise ConfigError(key, None, "a config group or block (missing)")
    arch = build_model_arch(cfg.model, command_line)
    recipe = {key: plain(cfg[key]) for key in RECIPE_KEYS if key not in ("arch", "eval")}
    recipe["eval"] = plain(cfg.eval) if cfg.get("eval") else workload_suite(recipe["workload"])
    recipe["arch"] = dataclasses.asdict(arch)
    # Stored only when screening is on, so studies made before screening resume unchanged.
    screen = plain(cfg.get("screen")) or {}
    if ScreenSettings.from_dict(screen).suite is not None:
        recipe["screen"] = screen
    runtime = recipe["runtime"]
    if isinstance(runtime, Mapping) and "dtype" in runtime:  # one spelling in the stored recipe
        dtype = compute_dtype_name(runtime["dtype"], arch.dtype, field="runtime.dtype")
        recipe["runtime"] = {**runtime, "dtype": dtype}
    return recipe


def workload_suite(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the suite preset a workload names: the recipe's eval block when the
    command line sets no eval= (validated with the study's model in build_setup)."""
    from kvtune.autotune.evaluation.suite import suite_fields

    return suite_fields(Workload.from_dict(workload).suite, field="workload.suite")


def recipe_differences(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two recipes."""
    keys = sorted(set(stored) | set(wanted))
    differences = []
    for key in keys:
        left, right = stored.get(key), wanted.get(key)
        if isinstance(left, Mapping) and isinstance(right, Mapping):
            differences += [f"{key}.{sub}" for sub in recipe_differences(left, right)]
        elif left != right:
            differences.append(key)
    return differences


@dataclass(frozen=True)
class TuneSetup:
    """A validated recipe: the objects every trial, worker and export uses."""

    recipe: dict[str, Any]
    model: str
    folder: Path
    arch: ModelArch
    device: DeviceSpec
    serve: ServeSettings
    workload: Workload
    search: SearchConfig
    objectives: tuple[str, ...]
    constraints: Constraints
    suite: Mapping[str, Any]
    runtime: RuntimeSettings
    screening: ScreenSettings = ScreenSettings()
    screen_suite: Mapping[str, Any] | None = None

    def trial_context(self) -> TrialContext:
        return TrialContext(
            model=self.model,
            folder=self.folder,
            arch=self.arch,
            device=self.device,
            serve=self.serve,
            workload=self.workload,
            suite=self.suite,
            runtime=self.runtime,
        )

    def screen(self, cache: JsonCache | None) -> Screen | None:
        """The cheap first look at drawn policies (None without screen.suite)."""
        if self.screen_suite is None or self.constraints.min_retention is None:
            return None
        context = dataclasses.replace(self.trial_context(), suite=self.screen_suite)
        measure = TrialEvaluator(context, cache).accuracy
        return Screen(self.screening, measure, self.constraints.min_retention)

    def search_space(self, profile_cache: JsonCache) -> SearchSpace:
        """Resolve the layer groups and measure the profiles the space derives from (each on
        first use of a model, cached): fp4 sensitivity where layers are grouped by it, the
        attention profile at the suite's context where the space selects or offers
        per-channel keys."""
        groups = self.search.layer_groups
        layers = self.arch.num_layers
        sensitivity = None
        if groups == ALL_LAYERS:
            resolved = tuple((layer,) for layer in range(layers))
        elif groups == 1:
            resolved = (tuple(range(layers)),)
        else:
            sensitivity = tuple(
                layer_sensitivity(
                    self.model, self.folder, self.arch, self.runtime, profile_cache
                ).scores
            )
            resolved = group_layers(sensitivity, groups)
        attention = None
        if self.search.selects or "channel" in self.search.knobs["k_scale_axis"]:
            geometry = self.search.profile_geometry(self.suite["context_tokens"])
            attention = attention_profile(self.folder, geometry, self.runtime, profile_cache)
        return SearchSpace(self.search, resolved, layers, Profiles(sensitivity, attention))


def _runtime(data: Mapping[str, Any]) -> RuntimeSettings:
    known = {f.name for f in dataclasses.fields(RuntimeSettings)}
    for key in data:
        if key not in known:
            raise ConfigError(f"runtime.{key}", data[key], f"one of {', '.join(sorted(known))}")
    runtime = RuntimeSettings(**data)
    if runtime.backend not in BACKENDS:
        raise ConfigError("runtime.backend", runtime.backend, f"one of {', '.join(BACKENDS)}")
    return runtime


def _suite(eval_cfg: Mapping[str, Any], model: str, runtime: RuntimeSettings) -> dict[str, Any]:
    """The eval preset with the study's model and runtime filled in, validated."""
    from kvtune.autotune.evaluation.suite import load_suite

    data = {
        **eval_cfg,
        "model": model,
        "backend": runtime.backend,
        "device": runtime.device,
        "dtype": runtime.dtype,
    }
    return load_suite(data).to_dict()


def _screen_suite(
    screening: ScreenSettings, constraints: Constraints, model: str, runtime: RuntimeSettings
) -> dict[str, Any] | None:
    """The screening suite's preset with the study's model and runtime, validated."""
    from kvtune.autotune.evaluation.suite import suite_fields

    if screening.suite is None:
        return None
    if constraints.min_retention is None:
        raise ConfigError(
            "screen.suite",
            screening.suite,
            "null unless constraints.min_retention is set (the screen's threshold)",
        )
    return _suite(suite_fields(screening.suite, field="screen.suite"), model, runtime)


def build_setup(recipe: Mapping[str, Any]) -> TuneSetup:
    """Validate a recipe into a TuneSetup (cheap; the embedded model converts on first use)."""
    arch = ModelArch(**recipe["arch"])
    workload = Workload.from_dict(recipe["workload"])
    arch.check_context(workload.max_model_len, "workload.max_model_len")
    model = str(recipe["model"].get("path") or recipe["model"]["name"])
    folder = resolve_model(model)
    serve_cfg = {
        **recipe["serve"],
        "max_model_len": workload.max_model_len,
        "expected_context_len": workload.context_len,
    }
    runtime = _runtime(recipe["runtime"])
    constraints = Constraints.from_dict(recipe["constraints"])
    screening = ScreenSettings.from_dict(recipe.get("screen"))
    return TuneSetup(
        recipe=dict(recipe),
        model=model,
        folder=folder,
        arch=arch,
        device=build_device(recipe["device"]),
        serve=ServeSettings(**serve_cfg),
        workload=workload,
        search=SearchConfig.from_dict(recipe["search"], arch),
        objectives=parse_objectives(recipe["objectives"]),
        constraints=constraints,
        suite=_suite(recipe["eval"], model, runtime),
        runtime=runtime,
        screening=screening,
        screen_suite=_screen_suite(screening, constraints, model, runtime),
    )
