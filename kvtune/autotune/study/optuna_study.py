"""The Optuna study: storage, sampler, warm starts, and the loop that runs trials.

One study per `study.name` in any SQLAlchemy storage (default SQLite at
studies/<name>/optuna.db). The study stores its recipe, so `kvtune worker` processes on other
machines join with the name and the storage alone. Heartbeats mark a killed worker's trial FAIL
after the grace period and re-queue its params. A trial that cannot be measured (OOM, NaN, a
combination the runtime refuses) is recorded FAIL with its reason and the study goes on.

The trial budget `n_trials` counts distinct policies measured (COMPLETE, or FAIL with a reason)
or in flight; workers check it before and after asking for a trial, so several workers never
overshoot it, and each waits for in-flight trials before it returns. The engine presets a study
names (`engine_presets`, e.g. vllm/nvfp4) are measured besides that budget, as queued trials
that carry the preset's name instead of params, so every study shows the engines' own formats on
its workload next to the tuned policies. A sampled policy that the
study already measured or is measuring (the same canonical policy, whatever params built it) is
not run again: the trial is pruned as a duplicate and an unmeasured policy is queued in its
place. Once every distinct policy of the search space is measured the study stops short of its
budget (TrialObjective.exhausted). With a screen (kvtune/autotune/study/screening.py) a drawn
policy first passes a cheaper suite; one screened out is pruned with its reason, outside the
budget, and the study stops once `screen.max_rejected` are.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.samplers import BaseSampler
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from kvtune.autotune.config.engine_presets import preset_names
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.bookkeeping import tolerant
from kvtune.autotune.study.objectives import Constraints, TrialFailure, directions
from kvtune.autotune.study.recipe import recipe_differences
from kvtune.autotune.study.screening import SCREEN_ATTR, SCREENED_OUT_ATTR, Screen
from kvtune.autotune.study.sqlite_locking import lock_sqlite_transactions
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy, canonical

logger = logging.getLogger(__name__)

SAMPLERS = ("tpe", "nsga2", "gp", "random", "grid")
MAX_GRID = 100_000
RECIPE_ATTR = "recipe"
FAILURE_ATTR = "failure_reason"
SURPLUS_ATTR = "surplus"
DUPLICATE_ATTR = "duplicate_of"
POLICY_ATTR = "policy"
ENGINE_PRESET_ATTR = "engine_preset"
WARM_START_ATTR = "warm_start"
# Recipe groups with a `name` field, for the name an error message suggests.
NAMED_GROUPS = ("model", "device", "workload", "eval")
# Random draws tried for an unmeasured policy before the space is enumerated (when small enough).
RESAMPLE_DRAWS = 200
POLL_SECONDS = 2.0
STARTED_ATTR = "started"
# A RUNNING trial that never reached the objective this long after Optuna handed it out is an
# orphan: its worker died between `ask` and the first heartbeat. Optuna's fail_stale_trials
# skips trials without a heartbeat, so without this the study would wait on it forever.
ORPHAN_AFTER_S = 60.0
# Each study's folder, under the working directory: its default database, trials.log and the
# results of the last invocation (trials.csv, plots, front policies, recipe, exports).
STUDIES = Path("studies")
# studies/examples/ holds committed example runs: a study of that name would mix a user's
# results into them.
EXAMPLES = "examples"


@dataclass(frozen=True)
class StudySettings:
    """The `study` block: which study, where, how many trials and how to sample them.

    storage: SQLAlchemy URL; None = sqlite:///studies/<name>/optuna.db (relative to the
        working directory). n_trials: the study's total budget (a rerun tops it up).
    heartbeat_interval_s, grace_period_s: a running trial whose worker has not beaten for
        grace_period_s is failed and re-queued (at most max_retries times).
    n_startup_trials: random trials before TPE/GP model the results; population_size: NSGA-II.
    engine_presets: conf/policy presets ("vllm/nvfp4") measured besides the n_trials budget.
    """

    name: str
    storage: str | None = None
    n_trials: int = 6
    sampler: str = "tpe"
    seed: int = 0
    warm_start: bool = True
    n_startup_trials: int = 4
    population_size: int = 8
    heartbeat_interval_s: int = 30
    grace_period_s: int = 90
    max_retries: int = 2
    engine_presets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        presets = self.engine_presets
        if isinstance(presets, str) or not all(isinstance(p, str) for p in presets):
            raise ConfigError("study.engine_presets", presets, "a list of preset names")
        object.__setattr__(self, "engine_presets", tuple(presets))
        known = preset_names()
        unknown = [p for p in self.engine_presets if p not in known]
        if unknown:
            raise ConfigError("study.engine_presets", unknown[0], f"names from {', '.join(known)}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError("study.name", self.name, "a non-empty name without '/'")
        if self.name == EXAMPLES:
            raise ConfigError(
                "study.name", self.name, f"another name ({STUDIES / EXAMPLES}/ holds examples)"
            )
        if self.sampler not in SAMPLERS:
            raise ConfigError("study.sampler", self.sampler, f"one of {', '.join(SAMPLERS)}")
        for field, minimum in (
            ("n_trials", 0),
            ("seed", 0),
            ("n_startup_trials", 0),
            ("population_size", 2),
            ("heartbeat_interval_s", 1),
            ("grace_period_s", 1),
            ("max_retries", 0),
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"study.{field}", value, f"an integer >= {minimum}")
        if self.grace_period_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "study.grace_period_s",
                self.grace_period_s,
                f"> heartbeat_interval_s={self.heartbeat_interval_s}",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudySettings:
        known = set(cls.__dataclass_fields__)
        for key in data:
            if key not in known:
                raise ConfigError(f"study.{key}", data[key], f"one of {', '.join(sorted(known))}")
        return cls(**data)

    @property
    def folder(self) -> Path:
        """studies/<name>/ under the working directory."""
        return STUDIES / self.name

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.folder / 'optuna.db'}"


def open_storage(
    settings: StudySettings, existing: bool = False, runs_trials: bool = True
) -> RDBStorage:
    """RDB storage with heartbeats. A SQLite file's folder is created first, unless the study
    must already exist (workers, exports): then a missing file is refused without creating it.
    runs_trials: this process claims queued trials, so SQLite's transactions take the write
    lock when they begin (sqlite_locking); readers (export, dashboard) leave them deferred and
    never hold up the workers."""
    url = settings.storage_url
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url.removeprefix("sqlite:///"))
        if existing and not path.is_file():
            raise ConfigError(
                "study.storage",
                url,
                f"an existing study database (no file {path}; start "
                "the study with kvtune tune, or give its study.storage)",
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # heartbeats and retries are "experimental" since 2.8
        warnings.simplefilter("ignore", ExperimentalWarning)
        storage = RDBStorage(
            url,
            heartbeat_interval=settings.heartbeat_interval_s,
            grace_period=settings.grace_period_s,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(settings.max_retries),
        )
    if runs_trials:
        lock_sqlite_transactions(storage)
    return storage


def check_sampler(settings: StudySettings, search: SearchConfig, num_layers: int) -> None:
    """Refuse a grid too large to enumerate (before any profiling or trial)."""
    size = search.size(search.num_groups(num_layers))
    if settings.sampler == "grid" and size > MAX_GRID:
        raise ConfigError(
            "study.sampler",
            settings.sampler,
            f"a search space of at most {MAX_GRID:,} combinations for grid; this one has "
            f"{size:,} (narrow conf/search or use tpe)",
        )


def make_sampler(settings: StudySettings, space: SearchSpace, seed: int) -> BaseSampler:
    """The configured sampler; constraints reach it through trial.set_constraint."""
    with warnings.catch_warnings():  # multivariate TPE, constant liar and GP are "experimental"
        warnings.simplefilter("ignore", ExperimentalWarning)
        return _sampler(settings, space, seed)


def _sampler(settings: StudySettings, space: SearchSpace, seed: int) -> BaseSampler:
    name = settings.sampler
    if name == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            constant_liar=True,
            n_startup_trials=settings.n_startup_trials,
        )
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=settings.population_size)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=settings.n_startup_trials)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    check_sampler(settings, space.config, space.num_layers)
    grid = {p: list(d.choices) for p, d in space.distributions().items()}
    return optuna.samplers.GridSampler(grid, seed=seed)


def create_or_resume(
    settings: StudySettings,
    storage: RDBStorage,
    recipe: Mapping[str, Any],
    objectives: Sequence[str],
) -> optuna.Study:
    """A new study holding the recipe, or the existing one if its recipe is the same."""
    names = optuna.get_all_study_names(storage)
    if settings.name in names:
        study = optuna.load_study(study_name=settings.name, storage=storage)
        differences = recipe_differences(study.user_attrs.get(RECIPE_ATTR, {}), recipe)
        if differences:
            group = differences[0].split(".")[0]
            group = group if group in NAMED_GROUPS else "workload"
            raise ConfigError(
                "study.name",
                settings.name,
                "a new name: a study of that name already exists with a different recipe "
                f"(differs in {', '.join(differences)}); name each recipe, e.g. "
                f"study.name='{settings.name}-${{{group}.name}}' (a multirun adds the swept "
                "values to the name by itself)",
            )
        logger.info("resuming study %s (%d trials so far)", settings.name, len(study.trials))
        return study
    study = optuna.create_study(
        study_name=settings.name,
        storage=storage,
        directions=directions(objectives),
        load_if_exists=True,
    )
    with warnings.catch_warnings():  # set_metric_names is "experimental" since 3.2
        warnings.simplefilter("ignore", ExperimentalWarning)
        study.set_metric_names(list(objectives))  # dashboards label axes by name, not 0, 1, 2
    study.set_user_attr(RECIPE_ATTR, dict(recipe))
    return study


def load_recipe(settings: StudySettings, storage: RDBStorage) -> tuple[optuna.Study, dict]:
    """An existing study and its recipe (for workers and exports)."""
    if settings.name not in optuna.get_all_study_names(storage):
        raise ConfigError(
            "study.name",
            settings.name,
            f"an existing study in {settings.storage_url} (start it with kvtune tune)",
        )
    study = optuna.load_study(study_name=settings.name, storage=storage)
    return study, dict(study.user_attrs[RECIPE_ATTR])


def enqueue_warm_starts(study: optuna.Study, space: SearchSpace, n_trials: int) -> None:
    """Queue the standard starting policies (at most n_trials; never twice)."""
    for name, params in list(space.warm_starts().items())[:n_trials]:
        study.enqueue_trial(params, user_attrs={WARM_START_ATTR: name}, skip_if_exists=True)


def enqueue_engine_presets(study: optuna.Study, names: Sequence[str]) -> None:
    """Queue a trial for each named engine preset the study has not queued yet (no params: the
    objective measures the preset's policy; see TrialObjective)."""
    queued = {t.user_attrs.get(ENGINE_PRESET_ATTR) for t in study.get_trials(deepcopy=False)}
    for name in names:
        if name not in queued:
            study.enqueue_trial({}, user_attrs={ENGINE_PRESET_ATTR: name, WARM_START_ATTR: name})


def screened_out(trial: FrozenTrial) -> bool:
    """Pruned by the screen: its policy failed the cheap first look (screening.py)."""
    return trial.state == TrialState.PRUNED and SCREENED_OUT_ATTR in trial.user_attrs


def trial_reason(trial: FrozenTrial) -> str | None:
    """Why a trial has no result: its failure, or the screen's verdict."""
    return trial.user_attrs.get(FAILURE_ATTR) or trial.user_attrs.get(SCREENED_OUT_ATTR)


def active(trial: FrozenTrial) -> bool:
    """Finished with a result or a reason (screened out included), in flight or queued (not a
    surplus or duplicate)."""
    if trial.user_attrs.get(SURPLUS_ATTR) or DUPLICATE_ATTR in trial.user_attrs:
        return False
    if trial.state == TrialState.FAIL:
        return FAILURE_ATTR in trial.user_attrs
    if trial.state == TrialState.PRUNED:
        return screened_out(trial)
    return trial.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)


def counted(trial: FrozenTrial) -> bool:
    """Whether a trial uses the budget: active, not an engine preset's, not screened out."""
    return active(trial) and ENGINE_PRESET_ATTR not in trial.user_attrs and not screened_out(trial)


def policy_key(policy: KVPolicy | Mapping[str, Any]) -> str:
    """A policy's identity: its canonical dict as sorted JSON, equal for every param set that
    builds the same cache."""
    if not isinstance(policy, KVPolicy):
        policy = KVPolicy.from_dict(policy)
    return json.dumps(canonical(policy).to_dict(), sort_keys=True)


def measuring(trial: FrozenTrial) -> bool:
    """Whether a trial measured its policy or is measuring it (active, past sampling)."""
    return active(trial) and trial.state != TrialState.WAITING and POLICY_ATTR in trial.user_attrs


class TrialObjective:
    """The function Optuna calls: sample a policy, measure it, report objectives."""

    def __init__(
        self,
        space: SearchSpace,
        evaluator: Callable[[KVPolicy], tuple[dict[str, float], bool]],
        objectives: Sequence[str],
        constraints: Constraints,
        n_trials: int,
        engine_presets: Mapping[str, KVPolicy] | None = None,
        screen: Screen | None = None,
    ) -> None:
        self.space = space
        self.screen = screen
        # Engine presets by name, as the study's model stores them (block and chunk sizes are
        # the search space's fixed ones when it fixes them).
        self.engine_presets = dict(engine_presets or {})
        self.evaluator = evaluator
        self.objectives = tuple(objectives)
        self.constraints = constraints
        self.n_trials = n_trials
        # Set once a duplicate found no unmeasured policy to queue: every distinct policy of
        # the space is measured (or in flight), so asking for more trials would loop forever.
        self.exhausted = False

    def spent(self, trials: Sequence[FrozenTrial]) -> bool:
        """No trial is worth asking for: the space is exhausted, or the screen has rejected
        its most (screen.max_rejected)."""
        if self.exhausted:
            return True
        limit = self.screen.settings.max_rejected if self.screen else None
        return limit is not None and sum(screened_out(t) for t in trials) >= limit

    def _look(self, trial: optuna.Trial, policy: KVPolicy) -> None:
        """The screen's first look at a drawn policy; prunes it when screened out."""
        if self.screen is None or WARM_START_ATTR in trial.user_attrs:
            return
        verdict = self.screen(policy)
        trial.set_user_attr(SCREEN_ATTR, verdict.to_dict())
        if verdict.passed:
            return
        trial.set_user_attr(SCREENED_OUT_ATTR, verdict.reason)
        trial.set_constraint("min_retention", self.screen.min_retention - verdict.retention)
        raise optuna.TrialPruned(verdict.reason)

    def _is_surplus(self, trial: optuna.Trial) -> bool:
        earlier = [
            t
            for t in trial.study.get_trials(deepcopy=False)
            if t.number < trial.number and counted(t)
        ]
        return len(earlier) >= self.n_trials

    def _measured_by(self, trial: optuna.Trial, key: str) -> int | None:
        """The trial that measured (or is measuring) this policy, other than `trial`.

        Called after `trial` published its policy, so of two workers sampling one policy at
        once at least one sees the other and yields (both may: neither is counted then).
        """
        for other in trial.study.get_trials(deepcopy=False):
            if (
                other.number != trial.number
                and measuring(other)
                and policy_key(other.user_attrs[POLICY_ATTR]) == key
            ):
                return other.number
        return None

    def _unmeasured_params(self, study: optuna.Study, seed: int) -> dict[str, Any] | None:
        """Params of a policy no trial has measured, is measuring or waits to measure: a seeded
        random draw, else (a small space) the first in enumeration order; None when none is
        left."""
        taken = set()
        for trial in study.get_trials(deepcopy=False):
            if measuring(trial):
                taken.add(policy_key(trial.user_attrs[POLICY_ATTR]))
            elif trial.state == TrialState.WAITING and ENGINE_PRESET_ATTR not in trial.user_attrs:
                fixed = trial.system_attrs.get("fixed_params", {})
                taken.add(policy_key(self.space.policy(fixed)))
        choices = {name: dist.choices for name, dist in self.space.distributions().items()}
        rng = random.Random(seed)
        for _ in range(RESAMPLE_DRAWS):
            params = {name: rng.choice(values) for name, values in choices.items()}
            if policy_key(self.space.policy(params)) not in taken:
                return params
        if math.prod(len(values) for values in choices.values()) > MAX_GRID:
            return None
        for combination in itertools.product(*choices.values()):
            params = dict(zip(choices, combination, strict=True))
            if policy_key(self.space.policy(params)) not in taken:
                return params
        return None

    def _preset_policy(self, trial: optuna.Trial, name: str) -> KVPolicy:
        """The named engine preset with the block and chunk sizes a trial of the space uses."""
        if name not in self.engine_presets:
            reason = f"engine preset {name}: no conf/policy/{name}.yaml here"
            trial.set_user_attr(FAILURE_ATTR, reason)
            raise TrialFailure(reason)
        base = self.space.policy({})
        policy = self.engine_presets[name]
        return policy.replace(block_size=base.block_size, chunk_size=base.chunk_size)

    def _replace_duplicate(self, trial: optuna.Trial, original: int) -> None:
        trial.set_user_attr(DUPLICATE_ATTR, original)
        params = self._unmeasured_params(trial.study, seed=trial.number)
        if params is None:
            self.exhausted = True
            return
        trial.study.enqueue_trial(params, user_attrs={"resampled_for": trial.number})

    def __call__(self, trial: optuna.Trial) -> list[float]:
        trial.set_user_attr(STARTED_ATTR, True)  # alive past the heartbeat's start: not an orphan
        preset = trial.user_attrs.get(ENGINE_PRESET_ATTR)
        if preset is None and self._is_surplus(trial):
            trial.set_user_attr(SURPLUS_ATTR, True)
            raise optuna.TrialPruned("another worker filled the trial budget first")
        policy = self._preset_policy(trial, preset) if preset else self.space.suggest(trial)
        trial.set_user_attr(POLICY_ATTR, policy.to_dict())
        original = self._measured_by(trial, policy_key(policy))
        if original is not None:
            if preset is None:
                self._replace_duplicate(trial, original)
            else:  # outside the budget: nothing to replace
                trial.set_user_attr(DUPLICATE_ATTR, original)
            raise optuna.TrialPruned(f"policy already measured by trial {original}")
        start = time.perf_counter()
        try:
            self._look(trial, policy)
            metrics, cached = self.evaluator(policy)
        except TrialFailure as failure:
            trial.set_user_attr(FAILURE_ATTR, failure.reason)
            raise
        trial.set_user_attr("metrics", metrics)
        trial.set_user_attr("cached", cached)
        trial.set_user_attr("seconds", time.perf_counter() - start)
        for name, value in self.constraints.values(metrics).items():
            trial.set_constraint(name, value)
        return [metrics[name] for name in self.objectives]


def fail_orphaned_trials(study: optuna.Study, orphan_after_s: float = ORPHAN_AFTER_S) -> None:
    """Fail each orphan (see ORPHAN_AFTER_S) and queue a retry that keeps the parameters it was
    given (a warm start's fixed ones included), as Optuna's stale-trial retry does."""
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        started = trial.datetime_start or now
        if STARTED_ATTR in trial.user_attrs or (now - started).total_seconds() < orphan_after_s:
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except ValueError:  # its worker was alive after all and finished it meanwhile
            continue
        logger.warning("trial %d never started (worker lost): failed, retried", trial.number)
        fixed = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                user_attrs=trial.user_attrs,
                system_attrs={"failed_trial": trial.number, "fixed_params": fixed},
            )
        )


def run_trials(
    study: optuna.Study,
    objective: TrialObjective,
    n_trials: int,
    callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = (),
    orphan_after_s: float = ORPHAN_AFTER_S,
) -> None:
    """Run trials until the budget is used (or every distinct policy of the space is measured:
    objective.exhausted), then wait for other workers' trials in flight.

    The callbacks are bookkeeping: an error in one is logged and recorded with its trial, and
    the study goes on (kvtune/autotune/study/bookkeeping.py).
    """
    callbacks = [tolerant(callback) for callback in callbacks]
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            fail_stale_trials(study)
        fail_orphaned_trials(study, orphan_after_s)
        trials = study.get_trials(deepcopy=False)
        budget = [t for t in trials if counted(t)]
        waiting = any(t.state == TrialState.WAITING and active(t) for t in trials)
        if (len(budget) < n_trials and not objective.spent(trials)) or waiting:
            study.optimize(objective, n_trials=1, catch=(TrialFailure,), callbacks=callbacks)
        elif any(t.state == TrialState.RUNNING and active(t) for t in trials):
            time.sleep(POLL_SECONDS)
        else:
            return
