"""`kvtune tune` and `kvtune export` end to end on the tiny model (subprocesses, real Hydra,
Optuna SQLite storage, MLflow sqlite store, runtime and suite)."""

import csv
import sqlite3

import optuna
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from kvtune.autotune.study.results import pick_trial, trial_records
from kvtune.runtime.policy import KVPolicy
from tests.autotune.analytic_study import new_study
from tests.autotune.conftest import run_kvtune

OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence", "tpot_ms")


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage)


@pytest.mark.slow
def test_study_tracks_exports_and_resumes(tmp_path, tiny_study_args, kvtune_cache):
    db, tracking = tmp_path / "data" / "optuna.db", tmp_path / "data" / "mlflow.db"
    db.parent.mkdir()
    storage = f"sqlite:///{db}"
    args = [
        "study.name=NAME",
        "study.n_trials=4",
        "eval=tiny",
        f"study.storage={storage}",
        f"mlflow.tracking_uri=sqlite:///{tracking}",
    ]
    result = run_kvtune("tune", *args, *tiny_study_args, cwd=tmp_path, cache=kvtune_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Pareto front of study NAME" in result.stdout
    # stdout is a pipe here: one plain line per trial, no live bar.
    progress = [line for line in result.stdout.splitlines() if line.startswith("NAME [")]
    assert [line.split("]")[0] for line in progress] == [f"NAME [{n}/4" for n in range(1, 5)]
    assert all("MiB/seq" in line and "\x1b" not in line for line in progress)

    study = load(storage, "NAME")
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)
    client = MlflowClient(f"sqlite:///{tracking}")
    experiment = client.get_experiment_by_name("NAME")
    runs = client.search_runs([experiment.experiment_id], "tags.`kvtune.kind` = 'trial'")
    assert sorted(int(r.data.tags["trial_number"]) for r in runs) == [0, 1, 2, 3]
    assert all("accuracy_retention" in r.data.metrics for r in runs)
    assert {r.data.tags["pareto"] for r in runs} <= {"true", "false"}
    assert any(r.data.tags["pareto"] == "true" for r in runs)
    runs_table = f"#/experiments/{experiment.experiment_id}?workflowType=machine_learning"
    assert runs_table in result.stdout  # where the trials are in MLflow 3.17's UI
    parent = client.search_runs([experiment.experiment_id], "tags.`kvtune.kind` = 'invocation'")
    artifacts = {a.path for a in client.list_artifacts(parent[0].info.run_id)}
    assert {"pareto_front.png", "pareto_front.html", "trials.csv"} <= artifacts

    exported = run_kvtune(
        "export",
        "study.name=NAME",
        f"study.storage={storage}",
        "pick=knee",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    folder = tmp_path / "studies" / "NAME" / "export" / "knee"
    assert {p.name for p in folder.iterdir()} == {
        "kvtune.yaml",
        "vllm.yaml",
        "sglang.args",
        "llama-server.args",
        "NOTES.md",
    }
    knee = pick_trial(trial_records(study), OBJECTIVES, "knee")
    assert KVPolicy.from_yaml((folder / "kvtune.yaml").read_text()) == knee.policy
    assert f"(trial {knee.number})" in (folder / "NOTES.md").read_text()

    again = run_kvtune(
        "tune",
        *args[:1],
        "study.n_trials=5",
        *args[2:],
        *tiny_study_args,
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = load(storage, "NAME").get_trials()
    measured = [t for t in resumed if t.state != TrialState.PRUNED]  # pruned: repeats skipped
    assert len(measured) == 5 and all(t.state == TrialState.COMPLETE for t in measured)
    assert len({str(t.user_attrs["policy"]) for t in measured}) == 5
    assert [t.datetime_start for t in resumed[:4]] == [t.datetime_start for t in trials]

    other = run_kvtune(
        "tune",
        "study.name=OTHER",
        "study.n_trials=4",
        "study.sampler=random",
        f"study.storage={storage}",
        f"mlflow.tracking_uri=sqlite:///{tracking}",
        *tiny_study_args,
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert other.returncode == 0, other.stderr[-3000:]
    warm = [t for t in load(storage, "OTHER").get_trials() if t.user_attrs.get("warm_start")]
    # The baseline and the 4-bit formats start (the tiny space selects nothing): free, both
    # measured by the first study.
    assert len(warm) == 2 and all(t.user_attrs["cached"] for t in warm)


@pytest.mark.slow
def test_a_study_measures_its_engine_presets_besides_its_budget(
    tmp_path, tiny_study_args, kvtune_cache
):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    result = run_kvtune(
        "tune",
        "study.name=PRESETS",
        "study.n_trials=1",
        f"study.storage={storage}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        *tiny_study_args,
        "study.engine_presets=[vllm/fp8,vllm/nvfp4]",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trials = load(storage, "PRESETS").get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials) and len(trials) == 3
    presets = {t.user_attrs.get("engine_preset"): t.user_attrs["policy"] for t in trials}
    assert presets["vllm/nvfp4"]["k_dtype"] == "fp4" and presets["vllm/nvfp4"]["group_size"] == 16
    assert presets["vllm/fp8"]["group_size"] == "tensor"
    assert presets["vllm/fp8"]["tensor_scale"] == "unit"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("PRESETS")
    runs = client.search_runs([experiment.experiment_id], "tags.`kvtune.kind` = 'trial'")
    assert {r.data.tags.get("warm_start") for r in runs} >= {"vllm/fp8", "vllm/nvfp4"}


def csv_trials(path) -> list[int]:
    with path.open() as rows:
        return [int(row["trial"]) for row in csv.DictReader(rows)]


@pytest.mark.slow
def test_bookkeeping_errors_never_stop_a_study_and_it_resumes(
    tmp_path, tiny_study_args, kvtune_cache
):
    def tune(n_trials: int):
        result = run_kvtune(
            "tune", f"study.n_trials={n_trials}", *tiny_study_args, cwd=tmp_path, cache=kvtune_cache
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Pareto front of study tiny-tiny" in result.stdout
        return " ".join(result.stdout.split())

    folder = tmp_path / "studies" / "tiny-tiny"  # named by model.name=tiny and workload=tiny
    (folder / "trials.csv").mkdir(parents=True)  # where the table goes, a folder: it fails
    out = tune(2)
    assert "bookkeeping failed, the study went on: trials.csv (IsADirectoryError" in out
    log = (folder / "trials.log").read_text()
    assert "trials.csv failed (IsADirectoryError" in log and "Traceback" in log
    others = {"pareto_front.png", "pareto_front.html", "recipe.yaml", "front"}
    assert others <= {p.name for p in folder.iterdir()}

    with sqlite3.connect(tmp_path / "mlflow.db") as store:  # MLflow can no longer log metrics
        store.execute("DROP TABLE metrics")  # (the next process's MLflow makes another, unusable)
    out = tune(3)  # resumes the study: one more trial, whose MLflow callback fails
    study = load(f"sqlite:///{folder / 'optuna.db'}", "tiny-tiny")
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 3
    error = study.user_attrs["bookkeeping_error:trial_2:StudyTracker.log_trial"]
    assert "(sqlite3.OperationalError)" in error and "INSERT INTO metrics" in error
    assert f"trial 2: StudyTracker.log_trial ({error[:80]}" in out
    assert (
        "trial 2: bookkeeping step StudyTracker.log_trial failed"
        in (folder / "trials.log").read_text()
    )

    (folder / "trials.csv").rmdir()
    tune(3)  # nothing left to measure; the results are written
    assert csv_trials(folder / "trials.csv") == [0, 1, 2]
    # Without study.name, export takes the study tune named for the same model and workload.
    names = [a for a in tiny_study_args if a.startswith(("hydra.searchpath=", "model.name="))]
    exported = run_kvtune("export", *names, "workload=tiny", cwd=tmp_path, cache=kvtune_cache)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {p.name for p in (folder / "export" / "knee").iterdir()} == {
        "kvtune.yaml",
        "vllm.yaml",
        "sglang.args",
        "llama-server.args",
        "NOTES.md",
    }


def tune_multirun(tmp_path, tiny_study_args, kvtune_cache, *overrides: str) -> None:
    """`kvtune tune -m workload=tiny,tiny2 study.n_trials=1 <overrides>` on the tiny model."""
    args = [a for a in tiny_study_args if not a.startswith("workload=")]
    result = run_kvtune(
        "tune",
        "-m",
        "workload=tiny,tiny2",
        "study.n_trials=1",
        *overrides,
        *args,
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_multirun_runs_one_study_per_workload(tmp_path, tiny_study_args, kvtune_cache):
    tune_multirun(tmp_path, tiny_study_args, kvtune_cache)
    for name in ("tiny-tiny", "tiny-tiny2"):
        study = load(f"sqlite:///{tmp_path / 'studies' / name / 'optuna.db'}", name)
        assert len(study.get_trials()) == 1
    assert {p.name for p in tmp_path.iterdir()} == {"studies", "mlflow.db", "mlartifacts"}


@pytest.mark.slow
def test_a_named_multirun_gives_one_study_per_combination(tmp_path, tiny_study_args, kvtune_cache):
    overrides = ("study.name=sweep", "study.seed=0,1", "runtime.dtype=float32")
    tune_multirun(tmp_path, tiny_study_args, kvtune_cache, *overrides)
    names = {p.name for p in (tmp_path / "studies").iterdir()} - {"multirun"}
    expected = {f"sweep-workload_{w}-study.seed_{s}" for w in ("tiny", "tiny2") for s in (0, 1)}
    assert names == expected
    for name in expected:
        study = load(f"sqlite:///{tmp_path / 'studies' / name / 'optuna.db'}", name)
        assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE]
        recipe = study.user_attrs["recipe"]
        assert recipe["workload"]["name"] == name.split("-")[1].removeprefix("workload_")
        assert recipe["runtime"]["dtype"] == "fp32"  # float32, as vLLM and PyTorch spell it


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("study.sampler=cmaes", "study.sampler"),
        ("search.csa_ratio=[1,64]", "search.csa_ratio"),
        ("objectives=[accuracy,tpot_ms]", "objectives"),
        ("mlflow.tracking_uri=./mlruns", "mlflow.tracking_uri"),
        ("study.name=examples", "study.name"),  # studies/examples/ holds the committed examples
    ],
)
def test_bad_input_is_one_line_naming_the_field(tmp_path, override, field, kvtune_cache):
    result = run_kvtune("tune", override, cwd=tmp_path, cache=kvtune_cache, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtune tune: error: ") and field in lines[0]
    assert not (tmp_path / "studies").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    "command", [("export", "study.name=absent", "pick=trial=3"), ("worker", "study.name=absent")]
)
def test_joining_a_missing_study_is_one_line_and_creates_nothing(tmp_path, command, kvtune_cache):
    result = run_kvtune(*command, cwd=tmp_path, cache=kvtune_cache, timeout=120)
    assert result.returncode == 2
    assert "study.storage" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["export", "worker", "dashboard"])
def test_without_a_name_a_command_looks_for_the_study_tune_names(tmp_path, command, kvtune_cache):
    new_study(tmp_path / "studies" / "demo", name="demo")
    for overrides, name in (
        ([], "smollm2-135m-longdoc"),
        (["workload=chat"], "smollm2-135m-chat"),
    ):
        result = run_kvtune(command, *overrides, cwd=tmp_path, cache=kvtune_cache, timeout=120)
        assert result.returncode == 2, result.stderr[-3000:]
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"kvtune {command}: error: study.name='{name}' is invalid: ")
        assert line.endswith("one of the studies in studies/: demo; elsewhere: give study.storage")
    assert {p.name for p in (tmp_path / "studies").iterdir()} == {"demo"}


@pytest.mark.slow
def test_a_study_stops_when_its_space_is_measured(tmp_path, tiny_study_args, kvtune_cache):
    # Two distinct policies (fp16/fp16 and fp16/fp8), a budget of four.
    narrow = [
        "search.layer_groups=1",
        "search.k_dtype=[fp16]",
        "search.v_dtype=[fp16,fp8]",
        "search.group_size=[16]",
        "search.scale_dtype=[fp16]",
        "search.recent_unquantized=[0]",
        "search.csa_ratio=[1]",
        "search.block_size=[8]",
    ]
    result = run_kvtune(
        "tune",
        "study.name=narrow",
        "study.n_trials=4",
        *tiny_study_args,
        *narrow,
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "study narrow: every distinct policy of the search space is measured (2 trials); "
        "stopped short of study.n_trials=4"
    ) in " ".join(result.stdout.split())
    study = load(f"sqlite:///{tmp_path / 'studies' / 'narrow' / 'optuna.db'}", "narrow")
    complete = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    pairs = sorted(
        (t.user_attrs["policy"]["k_dtype"], t.user_attrs["policy"]["v_dtype"]) for t in complete
    )
    assert pairs == [("fp16", "fp16"), ("fp16", "fp8")]
