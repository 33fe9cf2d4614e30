"""`kvtune export`: write deployable configs for one trial of a study.

`pick` chooses the trial: knee (the Pareto point closest to the ideal after scaling each
objective), max_accuracy, min_memory, or trial=<n>; `min_retention` and `max_kv_gib` filter
the candidates first. The study is the one `kvtune tune` names for the same model and workload
(study.name, default ${model.name}-${workload.name}), so `kvtune export` alone exports what
`kvtune tune` alone ran. Files go to studies/<name>/export/<pick>/ under the working directory.
The target device is the study's unless `device=<preset>` names another.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from kvtune.autotune.cli.existing_study import open_existing_study
from kvtune.autotune.config.settings import build_device
from kvtune.autotune.export.engines import write_export
from kvtune.autotune.study.optuna_study import StudySettings, load_recipe
from kvtune.autotune.study.recipe import build_setup, plain
from kvtune.autotune.study.results import TRIAL_PICK, pick_trial, trial_records
from kvtune.runtime.errors import ConfigError


def _optional_number(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(name, value, "a number >= 0, or null")
    return float(value)


def quote_pick(overrides: list[str]) -> list[str]:
    """Hydra's override grammar refuses a second '=', so `pick=trial=3` is quoted for it."""
    return [
        f"pick='{o.removeprefix('pick=')}'" if o.startswith(f"pick={TRIAL_PICK}") else o
        for o in overrides
    ]


def export_folder(settings: StudySettings, pick: str) -> Path:
    return settings.folder / "export" / pick.replace("=", "_")


def export_task(cfg: DictConfig) -> None:
    """`kvtune export [study.name=...] [study.storage=...] [pick=knee]`."""
    study_cfg = plain(cfg.study)
    pick = str(cfg.pick)
    min_retention = _optional_number("min_retention", cfg.min_retention)
    max_kv_gib = _optional_number("max_kv_gib", cfg.max_kv_gib)
    settings = StudySettings.from_dict({k: v for k, v in study_cfg.items() if v is not None})
    study, recipe = load_recipe(settings, open_existing_study(settings, runs_trials=False))
    setup = build_setup(recipe)
    device = build_device(plain(cfg.device)) if cfg.get("device") else setup.device
    records = trial_records(study)
    record = pick_trial(records, setup.objectives, pick, min_retention, max_kv_gib)
    folder = export_folder(settings, pick)
    paths = write_export(folder, record, setup, device, settings.name, pick, records)
    console = Console()
    console.print(f"trial {record.number} ({pick}) exported to {folder}/:")
    for path in paths:
        console.print(f"  {path.name}")
