"""`kvtune tune`: create (or resume) a study and run its trials, tracked in MLflow.

Order of work: validate every setting (one ConfigError line, nothing loaded), open the
storage, resolve the layer groups (the sensitivity profile, cached per model), queue the warm
starts, open the MLflow parent run, run trials with a progress bar, then write the result files
into studies/<name>/ (kvtune/autotune/tracking/result_files.py), log the same files and the
Pareto tags to MLflow and print the front as a table. Past validation, bookkeeping never stops
the study: an error there is logged and recorded (kvtune/autotune/study/bookkeeping.py).
`kvtune worker` runs the same loop on an existing study (kvtune/autotune/cli/worker.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.cli.report import render_front, trial_reporter
from kvtune.autotune.config.engine_presets import engine_presets
from kvtune.autotune.search.space import SearchSpace
from kvtune.autotune.study.bookkeeping import InvocationSteps, trial_errors
from kvtune.autotune.study.objectives import TrialEvaluator
from kvtune.autotune.study.optuna_study import (
    StudySettings,
    TrialObjective,
    check_sampler,
    create_or_resume,
    enqueue_engine_presets,
    enqueue_warm_starts,
    make_sampler,
    open_storage,
    run_trials,
)
from kvtune.autotune.study.recipe import TuneSetup, build_setup, plain, recipe_from_config
from kvtune.autotune.study.results import pareto_front, trial_records
from kvtune.autotune.tracking.mlflow_tracker import (
    StudyTracker,
    default_artifact_root,
    default_tracking_uri,
)
from kvtune.autotune.tracking.result_files import WRITERS, StudyResults
from kvtune.runtime.errors import ConfigError

logger = logging.getLogger(__name__)

TRIALS_LOG = "trials.log"
N_TRIALS_ATTR = "n_trials"
SAMPLER_ATTR = "sampler"


@dataclass(frozen=True)
class Services:
    """Where results go: MLflow tracking and the measurement caches."""

    tracking_uri: str
    artifact_root: Path
    evaluations: JsonCache | None
    profiles: JsonCache  # the measured model profiles the search space derives from

    @classmethod
    def from_config(cls, mlflow_cfg: Mapping[str, Any], cache_cfg: Mapping[str, Any]) -> Services:
        workdir = Path.cwd()
        uri = mlflow_cfg.get("tracking_uri") or default_tracking_uri(workdir)
        if not isinstance(uri, str) or uri.startswith(("file:", "/", ".")) or "://" not in uri:
            raise ConfigError(
                "mlflow.tracking_uri",
                uri,
                "a database URI such as sqlite:///path/mlflow.db (MLflow 3 refuses file stores)",
            )
        location = mlflow_cfg.get("artifact_location")
        root = Path(location).resolve() if location else default_artifact_root(workdir)
        enabled = cache_cfg.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError("cache.enabled", enabled, "true or false")
        folder = cache_cfg.get("dir")
        evaluations = (
            Path(folder) / "evaluations" if folder else default_cache_folder("evaluations")
        )
        profiles = Path(folder) / "profiles" if folder else default_cache_folder("profiles")
        return cls(uri, root, JsonCache(evaluations) if enabled else None, JsonCache(profiles))


def quiet_libraries() -> None:
    """Optuna's per-trial log lines would bury the progress bar; the trials are reported there
    and in MLflow instead."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextlib.contextmanager
def trial_output(folder: Path) -> Iterator[None]:
    """Send what trials write to stderr (lm-eval's and the runtime's inner progress bars,
    library warnings, bookkeeping errors with their tracebacks) to studies/<name>/trials.log,
    so the study's own bar stays readable."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / TRIALS_LOG).open("a") as log, contextlib.redirect_stderr(log):
        yield


def start_tracker(
    settings: StudySettings, setup: TuneSetup, space: SearchSpace, services: Services, command: str
) -> StudyTracker:
    """The invocation's MLflow parent run, described by the study's main settings."""
    return StudyTracker(
        services.tracking_uri,
        services.artifact_root,
        settings.name,
        command,
        {
            "model": setup.model,
            "workload": setup.workload.name,
            "sampler": settings.sampler,
            "n_trials": settings.n_trials,
            "objectives": ",".join(setup.objectives),
            "layer_groups": ";".join(",".join(map(str, g)) for g in space.groups),
        },
        setup.arch.num_layers,
    )


def write_files(results: StudyResults, folder: Path, steps: InvocationSteps) -> list[Path]:
    """The result files into the study's folder, each on its own; the paths written."""
    written: list[Path] = []
    for name, write in WRITERS.items():
        written += steps.run(name, write, folder, results) or []
    return written


def track_results(
    tracker: StudyTracker,
    study: optuna.Study,
    results: StudyResults,
    folder: Path,
    written: list[Path],
    steps: InvocationSteps,
) -> None:
    """The trials' tags, the files written and the invocation's failed steps to MLflow."""
    steps.run("MLflow trial tags", tracker.refresh_trial_tags, results.front, trial_errors(study))
    steps.run("MLflow artifacts", tracker.log_result_files, folder, written)
    steps.run("MLflow parent run", tracker.finish, results.front, dict(steps.failed))


def report_errors(
    console: Console, study: optuna.Study, folder: Path, steps: InvocationSteps
) -> None:
    """Name the study's recorded bookkeeping errors and this invocation's failed steps (the
    tracebacks are in trials.log)."""
    failed = [
        f"trial {n}: {step} ({text})"
        for n, e in trial_errors(study).items()
        for step, text in e.items()
    ]
    failed += [f"{step} ({text})" for step, text in steps.failed.items()]
    if failed:
        console.print(
            f"study {study.study_name}: bookkeeping failed, the study went on: {'; '.join(failed)}"
            f" (tracebacks in {folder / TRIALS_LOG})",
            soft_wrap=True,
            highlight=False,
        )


def run_study(
    settings: StudySettings,
    setup: TuneSetup,
    study: optuna.Study,
    services: Services,
    command: str,
    console: Console,
) -> None:
    """Run the study's trials from this process, then write, track and print the results.

    Only `kvtune tune` queues the warm starts: workers starting together would race to queue
    the same ones. Bookkeeping (MLflow, result files, the front table) never stops the study:
    see kvtune/autotune/study/bookkeeping.py.
    """
    space = setup.search_space(services.profiles)
    study.sampler = make_sampler(settings, space, settings.seed)
    if command == "tune" and settings.warm_start and settings.sampler != "grid":
        enqueue_warm_starts(study, space, settings.n_trials)
    if command == "tune":
        enqueue_engine_presets(study, settings.engine_presets)
    objective = TrialObjective(
        space,
        TrialEvaluator(setup.trial_context(), services.evaluations),
        setup.objectives,
        setup.constraints,
        settings.n_trials,
        engine_presets(setup.arch.cached_vector_size),
        setup.screen(services.evaluations),
    )
    steps = InvocationSteps(settings.name)
    with trial_output(settings.folder):
        tracker = steps.run(
            "MLflow parent run", start_tracker, settings, setup, space, services, command
        )
    callbacks = [] if tracker is None else [tracker.log_trial]
    try:
        reporter = trial_reporter(console, study, settings.n_trials + len(settings.engine_presets))
        with reporter as report, trial_output(settings.folder):
            run_trials(study, objective, settings.n_trials, [*callbacks, report])
    except BaseException:
        if tracker is not None:
            steps.run("MLflow parent run", tracker.fail)
        raise
    records = trial_records(study)
    if objective.exhausted:
        console.print(
            f"study {settings.name}: every distinct policy of the search space is measured "
            f"({len(records)} trials); stopped short of study.n_trials={settings.n_trials}"
        )
    front = [r.number for r in pareto_front(records, setup.objectives)]
    recipe = yaml.safe_dump(setup.recipe, sort_keys=False)
    results = StudyResults(records, front, setup.objectives, setup.arch.num_layers, recipe)
    with trial_output(settings.folder):
        written = write_files(results, settings.folder, steps)
        steps.run(
            "front table", render_front, console, settings.name, records, front, results.num_layers
        )
        if tracker is not None:
            track_results(tracker, study, results, settings.folder, written, steps)
    if written:
        names = ", ".join(str(p.relative_to(settings.folder)) for p in written)
        console.print(f"results in {settings.folder}/: {names}", soft_wrap=True, highlight=False)
    report_errors(console, study, settings.folder, steps)
    if tracker is not None:
        # MLflow 3.17's UI opens an experiment in its GenAI view whatever its tags say; this
        # address opens the runs table ("Model training") where the trials are.
        console.print(
            f"MLflow: mlflow ui --backend-store-uri {services.tracking_uri}, then "
            f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}"
            "?workflowType=machine_learning",
            soft_wrap=True,
        )


def swept_keys(argv: Sequence[str]) -> list[str]:
    """Keys a command line sweeps (`workload=chat,longdoc`, `study.seed=range(2)`)."""
    overrides = [arg for arg in argv if not arg.startswith("-")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def study_name(cfg: DictConfig, job_overrides: Sequence[str], argv: Sequence[str]) -> str:
    """study.name, extended in a multirun job by each swept value that the name does not
    interpolate already, so that every combination gets its own study: `study.name=sweep -m
    workload=chat,longdoc` -> sweep-workload_chat and sweep-workload_longdoc."""
    name = str(cfg.study.name)
    raw = str(cfg.study._get_node("name")._value())
    values = {
        o.key_or_group: o.get_value_element_as_str()
        for o in OverridesParser.create().parse_overrides(list(job_overrides))
    }
    suffix = [
        f"{key}_{_safe(values[key])}"
        for key in swept_keys(argv)
        if key in values
        and "${" + key not in raw
        and key != "study.name"
        and not key.startswith("hydra.")
    ]
    return "-".join([name, *suffix])


def _safe(value: str) -> str:
    """A value as it can stand in a file name and on a command line."""
    return re.sub(r"[^A-Za-z0-9._]+", "_", value).strip("_") or "_"


def tune_task(cfg: DictConfig) -> None:
    """`kvtune tune`: one study per invocation (Hydra multirun: one per combination)."""
    quiet_libraries()
    hydra_cfg = HydraConfig.get()
    name = cfg.study.name
    if hydra_cfg.mode == RunMode.MULTIRUN:
        name = study_name(cfg, hydra_cfg.overrides.task, sys.argv[1:])
    settings = StudySettings.from_dict({**plain(cfg.study), "name": name})
    recipe = recipe_from_config(cfg, hydra_cfg.overrides.task)
    setup = build_setup(recipe)
    services = Services.from_config(plain(cfg.mlflow), plain(cfg.cache))
    check_sampler(settings, setup.search, setup.arch.num_layers)
    storage = open_storage(settings)
    study = create_or_resume(settings, storage, recipe, setup.objectives)
    study.set_user_attr(N_TRIALS_ATTR, settings.n_trials)
    study.set_user_attr(SAMPLER_ATTR, settings.sampler)
    logger.info("study %s in %s (pid %d)", settings.name, settings.storage_url, os.getpid())
    run_study(settings, setup, study, services, "tune", Console())
