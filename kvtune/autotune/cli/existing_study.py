"""The study that export, dashboard and worker read: found where `kvtune tune` put it, or
refused in one line that names it and lists the studies there.

With no study.storage the study lives in studies/<name>/optuna.db under the working directory
(the rule of `kvtune tune`), so a missing one is answered with the studies/ folders that hold a
database; with a storage URL, with the studies that storage holds.
"""

from __future__ import annotations

import optuna
from optuna.storages import RDBStorage

from kvtune.autotune.study.optuna_study import STUDIES, StudySettings, open_storage
from kvtune.runtime.errors import ConfigError


def missing_study(name: str, where: str, names: list[str], note: str = "") -> ConfigError:
    """The one-line error for a study that is not there: the studies that are."""
    listed = ", ".join(names) or "none"
    return ConfigError("study.name", name, f"one of the studies in {where}: {listed}{note}")


def open_existing_study(settings: StudySettings, runs_trials: bool) -> RDBStorage:
    """The storage holding settings.name; nothing is created when it is not there."""
    if settings.storage is None and not (settings.folder / "optuna.db").is_file():
        found = sorted(p.parent.name for p in STUDIES.glob("*/optuna.db"))
        raise missing_study(settings.name, f"{STUDIES}/", found, "; elsewhere: give study.storage")
    storage = open_storage(settings, existing=True, runs_trials=runs_trials)
    names = optuna.get_all_study_names(storage)
    if settings.name not in names:
        raise missing_study(settings.name, settings.storage_url, names)
    return storage
