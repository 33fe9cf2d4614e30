"""`kvtune worker`: join an existing study from another process or machine.

The worker needs only the study's name and storage (the name defaults to the one `kvtune tune`
gives for the same model and workload, ${model.name}-${workload.name}): the recipe (model,
workload, search space, suite, objectives), the trial budget and the sampler are read from the
study. It runs trials until the budget is used, with heartbeats, then writes the study's results
and refreshes MLflow like `kvtune tune` does.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig
from rich.console import Console

from kvtune.autotune.cli.existing_study import open_existing_study
from kvtune.autotune.cli.tune import (
    N_TRIALS_ATTR,
    SAMPLER_ATTR,
    Services,
    quiet_libraries,
    run_study,
)
from kvtune.autotune.study.optuna_study import StudySettings, check_sampler, load_recipe
from kvtune.autotune.study.recipe import build_setup, plain

# Worker samplers draw from their own seed so that parallel workers do not propose alike.
SEED_SPREAD = 2**31 - 1


def worker_task(cfg: DictConfig) -> None:
    """`kvtune worker [study.name=...] study.storage=...`."""
    quiet_libraries()
    study_cfg = plain(cfg.study)
    connect = StudySettings.from_dict(
        {k: v for k, v in study_cfg.items() if v is not None and k not in ("n_trials", "sampler")}
    )
    study, recipe = load_recipe(connect, open_existing_study(connect, runs_trials=True))
    study_cfg["n_trials"] = study_cfg.get("n_trials") or study.user_attrs[N_TRIALS_ATTR]
    study_cfg["sampler"] = study_cfg.get("sampler") or study.user_attrs[SAMPLER_ATTR]
    if study_cfg.get("seed") is None:
        study_cfg["seed"] = os.getpid() % SEED_SPREAD
    settings = StudySettings.from_dict({k: v for k, v in study_cfg.items() if v is not None})
    setup = build_setup(recipe)
    check_sampler(settings, setup.search, setup.arch.num_layers)
    services = Services.from_config(plain(cfg.mlflow), plain(cfg.cache))
    run_study(settings, setup, study, services, "worker", Console())
