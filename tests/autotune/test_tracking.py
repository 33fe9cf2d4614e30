"""MLflow tracking on a real sqlite store: experiment per study, nested trial runs, Pareto tags
refreshed at the end, parent artifacts (the result files written into the study's folder)."""

from mlflow import MlflowClient

from kvtune.autotune.cli.tune import track_results, write_files
from kvtune.autotune.study.bookkeeping import InvocationSteps
from kvtune.autotune.study.optuna_study import enqueue_warm_starts, run_trials
from kvtune.autotune.study.results import pareto_front, trial_records
from kvtune.autotune.tracking.mlflow_tracker import StudyTracker
from kvtune.autotune.tracking.result_files import StudyResults
from tests.autotune.analytic_study import (
    OBJECTIVES,
    new_study,
    objective,
    refuse_compression,
    search_space,
)


def finish(tracker, study, folder):
    """The end of an invocation as `kvtune tune` runs it; no step may fail here."""
    records = trial_records(study)
    front = [r.number for r in pareto_front(records, OBJECTIVES)]
    results = StudyResults(records, front, OBJECTIVES, 4, "recipe: test\n")
    steps = InvocationSteps(study.study_name)
    track_results(tracker, study, results, folder, write_files(results, folder, steps), steps)
    assert steps.failed == {}
    return front


def tracked_study(tmp_path, measure, n_trials):
    settings, study = new_study(tmp_path, name="tracked")
    enqueue_warm_starts(study, search_space(), 1)  # the uncompressed baseline: one trial completes
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = StudyTracker(uri, tmp_path / "artifacts", "tracked", "tune", {"sampler": "tpe"}, 4)
    run_trials(study, objective(measure, n_trials=n_trials), n_trials, [tracker.log_trial])
    front = finish(tracker, study, tmp_path / "studies" / "tracked")
    return MlflowClient(uri), tracker, study, front


def test_one_nested_run_per_trial_with_params_metrics_and_pareto_tags(tmp_path):
    client, tracker, study, front = tracked_study(tmp_path, refuse_compression, 6)
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kvtune.kind") == "invocation"]
    children = [r for r in runs if r.data.tags.get("kvtune.kind") == "trial"]
    assert len(parents) == 1
    assert sorted(int(r.data.tags["trial_number"]) for r in children) == list(range(6))
    for run in children:
        number = int(run.data.tags["trial_number"])
        trial = study.trials[number]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.data.tags["state"] == trial.state.name
        assert run.data.tags["pareto"] == ("true" if number in front else "false")
        assert len(run.data.params["layers"].split()) == 4  # one K/V code pair a layer
        if trial.state.name == "COMPLETE":
            assert run.data.metrics["accuracy_retention"] == trial.values[0]
            assert run.info.status == "FINISHED"
        else:
            assert "compression refused" in run.data.tags["failure_reason"]
            assert run.info.status == "FAILED"
    assert front and any(r.data.tags["pareto"] == "true" for r in children)
    assert {r.info.status for r in children} == {"FINISHED", "FAILED"}


def test_parent_run_holds_the_study_artifacts(tmp_path):
    client, tracker, study, front = tracked_study(tmp_path, refuse_compression, 5)
    names = {a.path for a in client.list_artifacts(tracker.parent_id)}
    assert {"pareto_front.png", "pareto_front.html", "trials.csv", "recipe.yaml", "front"} <= names
    exported = {a.path for a in client.list_artifacts(tracker.parent_id, "front")}
    assert exported == {f"front/trial_{n}.kvtune.yaml" for n in front}
    csv_text = (tmp_path / "artifacts" / "tracked").rglob("trials.csv").__next__().read_text()
    assert csv_text.count("\n") == 6  # header + 5 trials
    assert client.get_run(tracker.parent_id).info.status == "FINISHED"


def test_pareto_tags_are_refreshed_across_invocations(tmp_path):
    client, first, study, _ = tracked_study(tmp_path, refuse_compression, 3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    second = StudyTracker(uri, tmp_path / "artifacts", "tracked", "worker", {}, 4)
    run_trials(study, objective(refuse_compression, n_trials=6), 6, [second.log_trial])
    front = finish(second, study, tmp_path / "studies" / "tracked")
    tags = {int(r.data.tags["trial_number"]): r.data.tags["pareto"] for r in second.trial_runs()}
    assert tags == {n: ("true" if n in front else "false") for n in range(6)}


def test_experiment_opens_on_the_runs_table_with_a_description(tmp_path):
    client, tracker, study, front = tracked_study(tmp_path, refuse_compression, 2)
    tags = client.get_experiment_by_name("tracked").tags
    # The value MLflow 3's UI reads to open the runs table ("Model training"), not GenAI traces.
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    note = tags["mlflow.note.content"]
    assert "**tracked**" in note and "- sampler: `tpe`" in note and "Compare" in note


def test_an_older_experiment_gets_the_tags_and_keeps_its_description(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("old", (tmp_path / "artifacts").as_uri())
    client.set_experiment_tag(experiment_id, "mlflow.note.content", "written by a user")
    StudyTracker(uri, tmp_path / "artifacts", "old", "tune", {}, 4)
    tags = client.get_experiment(experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert tags["mlflow.note.content"] == "written by a user"
