"""MLflow tracking of a study, logged directly with MlflowClient.

One experiment per study (named after it), one parent run per `kvtune tune` / `kvtune worker`
invocation, one nested child run per trial: the policy flattened into params (per-layer dtypes
as a compact string plus per-dtype layer counts), every metric, and tags (trial number, state,
failure reason, pareto=true|false). At the end of an invocation the pareto tags of every trial
run in the experiment are refreshed (with the bookkeeping errors recorded for its trial,
kvtune/autotune/study/bookkeeping.py), and the parent run gets the result files written into
studies/<name>/ (kvtune/autotune/tracking/result_files.py: the Pareto front as PNG and HTML,
all trials as CSV, the recipe and the front's policies). Runs share param and metric names,
so the MLflow UI compares them side by side (parallel coordinates included).

The experiment is tagged as model development (`mlflow.experimentKind`) and carries a markdown
description of what its runs hold. MLflow 3.17's UI ignores the tag and opens the view that its
per-browser switch names (GenAI by default, where runs are not listed), so the description's
first line, shown folded in every view, says where the runs are.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag
from optuna.trial import FrozenTrial, TrialState

from kvtune.autotune.study.bookkeeping import ERROR_ATTR
from kvtune.autotune.study.optuna_study import SURPLUS_ATTR, screened_out, trial_reason
from kvtune.autotune.study.results import policy_columns
from kvtune.autotune.study.screening import SCREEN_ATTR
from kvtune.runtime.policy import KVPolicy

logger = logging.getLogger(__name__)

TRIAL_KIND = "trial"
PARENT_KIND = "invocation"
MLFLOW_BATCH = 900  # below MLflow's 1000-entry log_batch limit
# The experiment kind MLflow 3's UI reads where it does not follow its GenAI / Model training
# switch (3.17 follows the switch: see the module docstring).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
DESCRIPTION_TAG = "mlflow.note.content"


def default_tracking_uri(workdir: Path) -> str:
    return f"sqlite:///{workdir.resolve() / 'mlflow.db'}"


def default_artifact_root(workdir: Path) -> Path:
    return workdir.resolve() / "mlartifacts"


def experiment_description(study_name: str, params: Mapping[str, Any]) -> str:
    """The experiment's markdown description: what the study is and where to look."""
    facts = "\n".join(f"- {key}: `{value}`" for key, value in params.items())
    return (
        f"kvtune study **{study_name}**: KV-cache policies measured on the kvtune runtime; "
        "its runs are in the **Model training** view (switch at the top left).\n\n"
        f"{facts}\n\n"
        "Each `kvtune tune` / `kvtune worker` invocation is a parent run holding the Pareto "
        "front (`pareto_front.png`, interactive `pareto_front.html`), all trials "
        "(`trials.csv`), the recipe and the front's policies (`front/`). Expand it for one "
        "nested run per trial: the policy as params, every metric, tags `pareto`, `state` and "
        "`failure_reason`. Select trial runs and press **Compare** for parallel coordinates.\n"
    )


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i : i + MLFLOW_BATCH] for i in range(0, len(items), MLFLOW_BATCH)] or [[]]


class StudyTracker:
    """The MLflow side of one invocation on one study."""

    def __init__(
        self,
        tracking_uri: str,
        artifact_root: Path,
        study_name: str,
        command: str,
        params: Mapping[str, Any],
        num_layers: int,
    ) -> None:
        for noisy in ("alembic", "mlflow.store.db.utils"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.num_layers = num_layers
        experiment = self.client.get_experiment_by_name(study_name)
        tags = {
            EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
            DESCRIPTION_TAG: experiment_description(study_name, params),
        }
        if experiment is None:
            location = (artifact_root / study_name).as_uri()
            self.experiment_id = self.client.create_experiment(study_name, location, tags)
        else:  # an experiment from before these tags; a description a user wrote is kept
            self.experiment_id = experiment.experiment_id
            for key, value in tags.items():
                if key not in experiment.tags:
                    self.client.set_experiment_tag(self.experiment_id, key, value)
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"{command} {time.strftime('%Y-%m-%d %H:%M:%S')}",
            tags={"kvtune.kind": PARENT_KIND, "kvtune.command": command},
        )
        self.parent_id = run.info.run_id
        self.client.log_batch(
            self.parent_id, params=[Param(k, str(v)) for k, v in params.items()], synchronous=True
        )

    def log_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Optuna callback: one child run for a finished trial (surplus ones never ran)."""
        if trial.user_attrs.get(SURPLUS_ATTR) or (
            trial.state == TrialState.PRUNED and not screened_out(trial)
        ):
            return
        tags = {
            "mlflow.parentRunId": self.parent_id,
            "kvtune.kind": TRIAL_KIND,
            "trial_number": str(trial.number),
            "state": trial.state.name,
            "pareto": "false",
        }
        reason = trial_reason(trial)
        if reason:
            tags["failure_reason"] = str(reason)[:5000]
        if "warm_start" in trial.user_attrs:
            tags["warm_start"] = trial.user_attrs["warm_start"]
        run_id = self.client.create_run(
            self.experiment_id, run_name=f"trial {trial.number}", tags=tags
        ).info.run_id
        try:
            self._log_params_and_metrics(run_id, trial)
        except Exception:  # not left RUNNING; the error is tagged at the end (refresh_trial_tags)
            with contextlib.suppress(Exception):
                self.client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
            raise
        status = RunStatus.FINISHED if trial.state == TrialState.COMPLETE else RunStatus.FAILED
        self.client.set_terminated(run_id, RunStatus.to_string(status))

    def _log_params_and_metrics(self, run_id: str, trial: FrozenTrial) -> None:
        """A trial's policy as params, its metrics as metrics."""
        policy = trial.user_attrs.get("policy")
        record_params = policy_columns(
            None if policy is None else KVPolicy.from_dict(policy), self.num_layers
        )
        params = [Param(k, str(v)) for k, v in record_params.items()]
        now = int(time.time() * 1000)
        metrics = [
            Metric(name, float(value), now, 0)
            for name, value in trial.user_attrs.get("metrics", {}).items()
        ]
        for name, value in trial.user_attrs.get(SCREEN_ATTR, {}).items():
            if name in ("accuracy_retention", "seconds"):
                metrics.append(Metric(f"screen_{name}", float(value), now, 0))
        if "cached" in trial.user_attrs:
            metrics.append(Metric("cached", float(trial.user_attrs["cached"]), now, 0))
            metrics.append(Metric("trial_seconds", float(trial.user_attrs["seconds"]), now, 0))
        for chunk in _chunks(params):
            self.client.log_batch(run_id, params=chunk, synchronous=True)
        for chunk in _chunks(metrics):
            self.client.log_batch(run_id, metrics=chunk, synchronous=True)

    def trial_runs(self) -> list[Any]:
        """Every trial run of the experiment (all invocations)."""
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.`kvtune.kind` = '{TRIAL_KIND}'",
                page_token=token,
            )
            runs += list(page)
            token = page.token
            if not token:
                return runs

    def refresh_trial_tags(
        self, front: Sequence[int], errors: Mapping[int, Mapping[str, str]]
    ) -> None:
        """Every trial run's `pareto` tag, and its trial's recorded bookkeeping errors."""
        for run in self.trial_runs():
            number = int(run.data.tags["trial_number"])
            tags = [RunTag("pareto", "true" if number in front else "false")]
            tags += [
                RunTag(f"{ERROR_ATTR}.{step}", text)
                for step, text in errors.get(number, {}).items()
            ]
            self.client.log_batch(run.info.run_id, tags=tags, synchronous=True)

    def log_result_files(self, folder: Path, paths: Sequence[Path]) -> None:
        """The invocation's result files, at their place relative to the study's folder."""
        for path in paths:
            where = path.parent.relative_to(folder).as_posix()
            self.client.log_artifact(self.parent_id, str(path), None if where == "." else where)

    def finish(self, front: Sequence[int], failed_steps: Mapping[str, str]) -> None:
        """Tag the front and the invocation's failed steps on the parent run, and close it."""
        tags = [RunTag("pareto_trials", ",".join(map(str, front)) or "none")]
        tags += [RunTag(f"{ERROR_ATTR}.{step}", text) for step, text in failed_steps.items()]
        self.client.log_batch(self.parent_id, tags=tags, synchronous=True)
        self.client.set_terminated(self.parent_id, "FINISHED")

    def fail(self) -> None:
        """Close the parent run as failed (the invocation stopped with an error)."""
        self.client.set_terminated(self.parent_id, "FAILED")
