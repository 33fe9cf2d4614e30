"""The study machinery on a real SQLite storage: budget, warm starts, failures, resume.

The objective is tests/autotune/analytic_study.py's formula, so outcomes are known exactly.
"""

import threading

import optuna
import pytest
from optuna.trial import TrialState

from autotune.search.space import SearchConfig
from autotune.study.optuna_study import (
    FAILURE_ATTR,
    SAMPLERS,
    StudySettings,
    check_sampler,
    counted,
    create_or_resume,
    enqueue_warm_starts,
    load_recipe,
    make_sampler,
    open_storage,
    run_trials,
)
from runtime.arch import ModelArch
from runtime.errors import ConfigError
from runtime.kv_bytes import kv_bytes_per_sequence
from tests.autotune.analytic_study import (
    ARCH,
    OBJECTIVES,
    RECIPE,
    SEARCH,
    new_study,
    objective,
    refuse_compression,
    search_space,
)


def test_runs_exactly_the_budget_warm_starts_first(tmp_path):
    settings, study = new_study(tmp_path, n_trials=6)
    study.sampler = make_sampler(settings, search_space(), 0)
    enqueue_warm_starts(study, search_space(), 6)
    run_trials(study, objective(), 6)
    trials = study.get_trials()
    assert len(trials) == 6 and all(t.state == TrialState.COMPLETE for t in trials)
    assert [t.user_attrs.get("warm_start") for t in trials[:4]] == [
        "baseline",
        "all-fp8",
        "fp4-shallow-fp8-deep",
        "k-fp8-v-fp4",
    ]
    assert trials[0].values == [
        1.0,
        float(kv_bytes_per_sequence(ARCH, search_space().policy(trials[0].params), 512)),
    ]
    assert all("policy" in t.user_attrs and "metrics" in t.user_attrs for t in trials)


def test_failed_trials_are_recorded_with_their_reason_and_the_study_goes_on(tmp_path):
    settings, study = new_study(tmp_path)
    study.sampler = optuna.samplers.RandomSampler(seed=3)
    run_trials(study, objective(refuse_compression, n_trials=8), 8)
    trials = study.get_trials()
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(trials) == 8 and failed
    assert all("compression refused" in t.user_attrs[FAILURE_ATTR] for t in failed)
    assert all(t.params["csa_ratio"] == 2 for t in failed)


def test_constraints_reach_the_trials(tmp_path):
    settings, study = new_study(tmp_path)
    run_trials(study, objective(n_trials=5, min_retention=0.9), 5)
    for trial in study.get_trials():
        assert trial.constraints["min_retention"] == pytest.approx(
            0.9 - trial.user_attrs["metrics"]["accuracy_retention"]
        )


def test_rerun_with_the_same_name_resumes_and_tops_up(tmp_path):
    settings, study = new_study(tmp_path)
    run_trials(study, objective(n_trials=3), 3)
    settings, again = new_study(tmp_path)
    assert len(again.get_trials()) == 3
    run_trials(again, objective(n_trials=5), 5)
    assert len(again.get_trials()) == 5
    _, recipe = load_recipe(settings, open_storage(settings))
    assert recipe == RECIPE


def test_a_different_recipe_under_the_same_name_is_refused(tmp_path):
    settings, study = new_study(tmp_path)
    storage = open_storage(settings)
    with pytest.raises(ConfigError, match="differs in objectives"):
        create_or_resume(settings, storage, {**RECIPE, "objectives": ["tpot_ms"]}, OBJECTIVES)


def test_a_trial_past_the_budget_is_surplus_and_never_measured(tmp_path):
    settings, study = new_study(tmp_path)
    run_trials(study, objective(n_trials=2), 2)
    late = objective(n_trials=2)
    study.optimize(late, n_trials=1)  # as if a second worker asked just before the budget filled
    surplus = study.get_trials()[-1]
    assert surplus.state == TrialState.PRUNED and not counted(surplus)
    assert "metrics" not in surplus.user_attrs


def test_missing_study_is_named(tmp_path):
    settings = StudySettings(name="nope", storage=f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(ConfigError, match="study.name"):
        load_recipe(settings, open_storage(settings))


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_runs_a_study(tmp_path, sampler):
    settings, study = new_study(tmp_path, sampler=sampler, n_startup_trials=2, population_size=2)
    study.sampler = make_sampler(settings, search_space(), 0)
    run_trials(study, objective(n_trials=4), 4)
    assert sum(t.state == TrialState.COMPLETE for t in study.get_trials()) == 4


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"sampler": "cmaes"}, "study.sampler"),
        ({"n_trials": -1}, "study.n_trials"),
        ({"name": ""}, "study.name"),
        ({"grace_period_s": 10, "heartbeat_interval_s": 30}, "study.grace_period_s"),
    ],
)
def test_bad_study_settings_fail_naming_the_field(changes, field):
    with pytest.raises(ConfigError) as error:
        StudySettings.from_dict({"name": "s", **changes})
    assert error.value.field == field


def test_grid_refuses_a_space_too_large_to_enumerate():
    config = SearchConfig.from_dict(SEARCH, ModelArch("big", 12, 4, 2, 16, 1 << 20, 4096))
    with pytest.raises(ConfigError, match="study.sampler"):
        check_sampler(StudySettings(name="g", sampler="grid"), config, 12)


def test_a_trial_whose_worker_died_before_its_heartbeat_is_failed_and_retried(tmp_path):
    """A worker killed between Optuna's ask and the first heartbeat leaves a RUNNING trial that
    fail_stale_trials never fails; the study must not wait on it forever."""
    settings, study = new_study(tmp_path)
    enqueue_warm_starts(study, search_space(), 1)
    orphan = study.ask()  # taken, never started: no heartbeat, no objective
    finished = threading.Event()

    def run() -> None:
        run_trials(study, objective(n_trials=3), 3, orphan_after_s=0.0)
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    assert finished.wait(timeout=120), "the study waited on the orphaned trial"
    trials = study.get_trials()
    assert trials[orphan.number].state == TrialState.FAIL
    assert FAILURE_ATTR not in trials[orphan.number].user_attrs  # not counted: lost, not refused
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].user_attrs["warm_start"] == "baseline"
    assert retries[0].params == study.trials[orphan.number].system_attrs["fixed_params"]
    budget = [t for t in trials if counted(t)]
    assert len(budget) == 3 and all(t.state == TrialState.COMPLETE for t in budget)
