"""Bookkeeping never stops a study: a failing callback or a broken MLflow store is logged and
recorded with its trial, the study completes its budget, and the end steps each run on their own
(real SQLite Optuna storage, real MLflow sqlite store, the analytic objective of
tests/autotune/analytic_study.py). The command end to end: tests/autotune/test_tune_cli.py."""

import csv
import logging
import sqlite3

import optuna
from mlflow import MlflowClient
from optuna.trial import TrialState

from kvtune.autotune.cli.tune import track_results, write_files
from kvtune.autotune.study.bookkeeping import InvocationSteps, trial_errors
from kvtune.autotune.study.optuna_study import FAILURE_ATTR, run_trials
from kvtune.autotune.study.results import pareto_front, trial_records
from kvtune.autotune.tracking.mlflow_tracker import StudyTracker
from kvtune.autotune.tracking.result_files import StudyResults
from tests.autotune.analytic_study import OBJECTIVES, new_study, objective, refuse_compression


def fails_on_trial_2(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    if trial.number == 2:
        raise KeyError("int3")  # what the MLflow callback raised on 2026-12-05


def bookkeeping_warnings(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "kvtune.autotune.study.bookkeeping" and r.levelno == logging.WARNING
    ]


def test_a_failing_callback_is_recorded_with_its_trial_and_the_study_goes_on(tmp_path, caplog):
    settings, study = new_study(tmp_path)
    study.sampler = optuna.samplers.RandomSampler(seed=3)  # draws compressed policies: FAILs
    seen: list[int] = []
    with caplog.at_level(logging.WARNING):
        run_trials(
            study,
            objective(refuse_compression, n_trials=8),
            8,
            [fails_on_trial_2, lambda s, t: seen.append(t.number)],
        )
    trials = study.get_trials()
    assert len(trials) == 8 and seen == list(range(8))  # the next callback ran for trial 2 too
    assert study.user_attrs["bookkeeping_error:trial_2:fails_on_trial_2"] == "KeyError: 'int3'"
    assert trial_errors(study) == {2: {"fails_on_trial_2": "KeyError: 'int3'"}}
    [warning] = bookkeeping_warnings(caplog)
    message = warning.getMessage()
    assert "trial 2" in message and "fails_on_trial_2" in message and "KeyError: 'int3'" in message
    assert warning.exc_info is not None  # the traceback goes to the log with it
    # Measuring is not bookkeeping: a refused policy is still a FAIL trial with its reason.
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert failed and all("compression refused" in t.user_attrs[FAILURE_ATTR] for t in failed)


def results_of(study: optuna.Study) -> StudyResults:
    records = trial_records(study)
    front = [r.number for r in pareto_front(records, OBJECTIVES)]
    return StudyResults(records, front, OBJECTIVES, 4, "recipe: test\n")


def csv_trials(path) -> list[int]:
    with path.open() as rows:
        return [int(row["trial"]) for row in csv.DictReader(rows)]


def test_a_broken_mlflow_store_costs_the_tracking_not_the_study(tmp_path, caplog):
    settings, study = new_study(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, tmp_path / "artifacts", "s", "tune", {}, 4)
    run_trials(study, objective(n_trials=2), 2, [tracker.log_trial])
    with sqlite3.connect(tmp_path / "mlflow.db") as store:  # metrics can no longer be logged
        store.execute("DROP TABLE metrics")
    with caplog.at_level(logging.WARNING):
        run_trials(study, objective(n_trials=4), 4, [tracker.log_trial])
        folder = tmp_path / "studies" / "s"
        steps = InvocationSteps("s")
        results = results_of(study)
        track_results(tracker, study, results, folder, write_files(results, folder, steps), steps)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 4
    errors = trial_errors(study)
    assert sorted(errors) == [2, 3]
    assert all("no such table: metrics" in e["StudyTracker.log_trial"] for e in errors.values())
    assert len(bookkeeping_warnings(caplog)) >= 2
    # The result files do not depend on MLflow.
    assert csv_trials(folder / "trials.csv") == [0, 1, 2, 3]
    client = MlflowClient(uri)
    runs = {
        int(r.data.tags["trial_number"]): r
        for r in client.search_runs(
            [tracker.experiment_id], "tags.`kvtune.kind` = 'trial'", max_results=100
        )
    }
    assert sorted(runs) == [0, 1, 2, 3]
    for number in (2, 3):  # closed as failed, the error named on the run
        assert runs[number].info.status == "FAILED"
        tag = runs[number].data.tags["bookkeeping_error.StudyTracker.log_trial"]
        assert "no such table: metrics" in tag
    assert "bookkeeping_error.StudyTracker.log_trial" not in runs[1].data.tags
    # A later invocation on the same broken store resumes and completes the budget.
    again = StudyTracker(uri, tmp_path / "artifacts", "s", "worker", {}, 4)
    run_trials(study, objective(n_trials=6), 6, [again.log_trial])
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 6
    assert sorted(trial_errors(study)) == [2, 3, 4, 5]


def test_each_end_step_fails_on_its_own(tmp_path, caplog):
    settings, study = new_study(tmp_path)
    run_trials(study, objective(n_trials=3), 3)
    folder = tmp_path / "studies" / "s"
    (folder / "trials.csv").mkdir(parents=True)  # a file that cannot be written
    (tmp_path / "artifacts").write_text("a file where MLflow's artifact folder should be")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, tmp_path / "artifacts", "s", "tune", {}, 4)
    steps = InvocationSteps("s")
    results = results_of(study)
    with caplog.at_level(logging.WARNING):
        track_results(tracker, study, results, folder, write_files(results, folder, steps), steps)
    assert sorted(steps.failed) == ["MLflow artifacts", "trials.csv"]
    assert steps.failed["trials.csv"].startswith("IsADirectoryError")
    messages = [r.getMessage() for r in bookkeeping_warnings(caplog)]
    assert any("trials.csv failed (IsADirectoryError" in m for m in messages)
    # The other files were written, and the parent run was closed with the failures named.
    assert {"pareto_front.png", "pareto_front.html", "recipe.yaml", "front"} <= {
        p.name for p in folder.iterdir()
    }
    parent = MlflowClient(uri).get_run(tracker.parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["bookkeeping_error.trials.csv"].startswith("IsADirectoryError")
    assert "bookkeeping_error.MLflow artifacts" in parent.data.tags
