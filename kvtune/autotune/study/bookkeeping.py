"""Bookkeeping never stops a study.

Bookkeeping is what is written down once a trial is measured and stored (its MLflow run, the
progress line) and at the end of an invocation (trials.csv, plots, front policies, recipe,
MLflow artifacts and tags, the front table). An error there is logged through `logging` (into
studies/<name>/trials.log while `kvtune tune` runs trials, on stderr otherwise, with its
traceback) and recorded, and the study goes on; the other steps still run. Measuring is not
bookkeeping: a trial that cannot be measured fails with its reason (TrialFailure), and a
ConfigError still stops the command before any trial.

Where an error is recorded. Optuna refuses user attrs on a finished trial, so an error in a
per-trial callback is a user attr of the study, one key per trial and step:
`bookkeeping_error:trial_<n>:<step>` -> "<ExceptionType>: <message>". One key each needs no
read-modify-write, so workers finishing together never overwrite each other's record, and
every command and optuna-dashboard (the study's user attrs) see it. At the end of an invocation
it is also tagged on that trial's MLflow run, where the run exists (`bookkeeping_error.<step>`).
An end-of-invocation step's error belongs to that invocation: it is tagged on the invocation's
MLflow parent run and named in the command's last lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import optuna
from optuna.trial import FrozenTrial

logger = logging.getLogger(__name__)

ERROR_ATTR = "bookkeeping_error"
# MLflow tags hold at most 8,000 characters in the sqlite store; an error's first line is enough
# beside the traceback in the log.
MAX_ERROR_CHARS = 1000

Callback = Callable[[optuna.Study, FrozenTrial], None]
T = TypeVar("T")


def error_text(error: BaseException) -> str:
    """An error as one line: its type and message."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:MAX_ERROR_CHARS]


def trial_error_key(number: int, step: str) -> str:
    return f"{ERROR_ATTR}:trial_{number}:{step}"


def trial_errors(study: optuna.Study) -> dict[int, dict[str, str]]:
    """The study's recorded per-trial errors: trial number -> step -> error."""
    errors: dict[int, dict[str, str]] = {}
    for key, text in study.user_attrs.items():
        prefix, _, rest = key.partition(":trial_")
        if prefix == ERROR_ATTR:
            number, _, step = rest.partition(":")
            errors.setdefault(int(number), {})[step] = str(text)
    return dict(sorted(errors.items()))


def step_name(callback: Callback) -> str:
    """What a callback is called in the record: StudyTracker.log_trial, TrialLines, ..."""
    return getattr(callback, "__qualname__", type(callback).__name__)


def record_trial_error(study: optuna.Study, number: int, step: str, error: Exception) -> None:
    """Log a per-trial bookkeeping error and record it in the study (see the module docstring)."""
    text = error_text(error)
    logger.warning(
        "study %s, trial %d: bookkeeping step %s failed (%s); the study goes on",
        study.study_name,
        number,
        step,
        text,
        exc_info=error,
    )
    try:
        study.set_user_attr(trial_error_key(number, step), text)
    except Exception:  # the storage itself is failing: the log line is the record
        logger.exception("study %s: could not record trial %d's error", study.study_name, number)


def tolerant(callback: Callback) -> Callback:
    """An Optuna callback whose errors are recorded with the trial instead of stopping the
    study (Optuna's optimize lets a callback's exception end it)."""
    step = step_name(callback)

    def call(study: optuna.Study, trial: FrozenTrial) -> None:
        try:
            callback(study, trial)
        except Exception as error:
            record_trial_error(study, trial.number, step, error)

    return call


class InvocationSteps:
    """The steps of one invocation outside the trials (MLflow's parent run, result files, the
    front table), each run on its own: an error is logged and kept, and the next step runs."""

    def __init__(self, study_name: str) -> None:
        self.study_name = study_name
        self.failed: dict[str, str] = {}

    def run(self, step: str, action: Callable[..., T], *args: Any) -> T | None:
        """action(*args), or None when it raised (logged and kept in `failed`)."""
        try:
            return action(*args)
        except Exception as error:
            self.failed[step] = error_text(error)
            logger.warning(
                "study %s: %s failed (%s); the other steps go on",
                self.study_name,
                step,
                self.failed[step],
                exc_info=error,
            )
            return None
