"""The study machinery on a real SQLite storage: budget, warm starts, failures, resume.

The objective is tests/autotune/analytic_study.py's formula, so outcomes are known exactly.
"""

import threading
import time

import optuna
import pytest
from optuna.trial import TrialState

from kvtune.autotune.config.engine_presets import engine_presets
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.objectives import Constraints
from kvtune.autotune.study.optuna_study import (
    DUPLICATE_ATTR,
    FAILURE_ATTR,
    SAMPLERS,
    StudySettings,
    TrialObjective,
    check_sampler,
    counted,
    create_or_resume,
    enqueue_engine_presets,
    enqueue_warm_starts,
    load_recipe,
    make_sampler,
    open_storage,
    run_trials,
)
from kvtune.autotune.study.results import trial_records
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy
from tests.autotune.analytic_study import (
    ARCH,
    OBJECTIVES,
    RECIPE,
    SEARCH,
    analytic_measure,
    finishes,
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
    starts = [t.user_attrs.get("warm_start") for t in trials]
    assert starts == ["baseline", "profile-formats", None, None, None, None]
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
    # The resumed seeded sampler proposes trial 0's policy again: pruned, not counted.
    measured = [t for t in again.get_trials() if counted(t)]
    assert len(measured) == 5 and all(t.state == TrialState.COMPLETE for t in measured)
    assert len({str(t.user_attrs["policy"]) for t in measured}) == 5
    _, recipe = load_recipe(settings, open_storage(settings))
    assert recipe == RECIPE


def test_a_different_recipe_under_the_same_name_is_refused(tmp_path):
    settings, study = new_study(tmp_path)
    storage = open_storage(settings)
    with pytest.raises(ConfigError, match="differs in objectives"):
        create_or_resume(settings, storage, {**RECIPE, "objectives": ["tpot_ms"]}, OBJECTIVES)
    suggestion = r"differs in model.name.*study.name='s-\$\{model.name\}'"
    with pytest.raises(ConfigError, match=suggestion):
        create_or_resume(settings, storage, {**RECIPE, "model": {"name": "other"}}, OBJECTIVES)


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
    assert finishes(lambda: run_trials(study, objective(n_trials=3), 3, orphan_after_s=0.0)), (
        "the study waited on the orphaned trial"
    )
    trials = study.get_trials()
    assert trials[orphan.number].state == TrialState.FAIL
    assert FAILURE_ATTR not in trials[orphan.number].user_attrs  # not counted: lost, not refused
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].user_attrs["warm_start"] == "baseline"
    assert retries[0].params == study.trials[orphan.number].system_attrs["fixed_params"]
    budget = [t for t in trials if counted(t)]
    assert len(budget) == 3 and all(t.state == TrialState.COMPLETE for t in budget)


# Two dtypes, one layer group, two group sizes, no compression: 8 param sets but 7 distinct
# policies, since fp16/fp16 stores no scales and its group size means nothing.
FEW_POLICIES = {**SEARCH, "layer_groups": 1, "k_dtype": ["fp16", "fp8"], "v_dtype": ["fp16", "fp8"]}
FEW_POLICIES["csa_ratio"] = [1]
DISTINCT = {("fp16", "fp16")} | {
    (k, v, g) for k, v in (("fp16", "fp8"), ("fp8", "fp16"), ("fp8", "fp8")) for g in (8, 16)
}


def few_policies_space() -> SearchSpace:
    return SearchSpace(SearchConfig.from_dict(FEW_POLICIES, ARCH), (tuple(range(4)),), 4)


class RecordingMeasure:
    """The analytic measurement, remembering every policy it was asked to measure."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.policies: list[tuple] = []
        self.lock = threading.Lock()
        self.delay_s = delay_s

    def __call__(self, policy):
        quantized = "fp8" in (policy.k_dtype, policy.v_dtype)
        identity = (policy.k_dtype, policy.v_dtype)
        with self.lock:
            self.policies.append((*identity, policy.group_size) if quantized else identity)
        time.sleep(self.delay_s)
        return analytic_measure(policy)


def few_policies_objective(measure, n_trials):
    return TrialObjective(few_policies_space(), measure, OBJECTIVES, Constraints(), n_trials)


def test_a_policy_is_measured_once_even_across_a_resume(tmp_path):
    measure = RecordingMeasure()
    settings, study = new_study(tmp_path)
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    run_trials(study, few_policies_objective(measure, 4), 4)
    settings, resumed = new_study(tmp_path)
    resumed.sampler = optuna.samplers.RandomSampler(seed=1)
    run_trials(resumed, few_policies_objective(measure, 7), 7)
    assert sorted(measure.policies, key=str) == sorted(DISTINCT, key=str)  # each exactly once
    trials = resumed.get_trials()
    duplicates = [t for t in trials if DUPLICATE_ATTR in t.user_attrs]
    assert duplicates and all(t.state == TrialState.PRUNED for t in duplicates)
    assert sum(counted(t) for t in trials) == 7
    records = trial_records(resumed)
    assert len(records) == 7 and all(r.complete for r in records)


def test_an_exhausted_space_stops_the_study_short_of_its_budget(tmp_path):
    measure = RecordingMeasure()
    settings, study = new_study(tmp_path)
    study.sampler = optuna.samplers.TPESampler(seed=0, n_startup_trials=2)
    objective = few_policies_objective(measure, 20)
    assert finishes(lambda: run_trials(study, objective, 20)), (
        "the study kept asking for trials in an exhausted space"
    )
    assert objective.exhausted
    assert sorted(measure.policies, key=str) == sorted(DISTINCT, key=str)
    assert sum(t.state == TrialState.COMPLETE for t in study.get_trials()) == 7


def run_two_workers(settings, measure: RecordingMeasure, n_trials: int) -> None:
    """Two workers (threads, each with its own storage connection) on one study; a worker's
    exception fails the test instead of dying with its thread."""
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            study = optuna.load_study(study_name=settings.name, storage=open_storage(settings))
            study.sampler = optuna.samplers.RandomSampler(seed=seed)
            run_trials(study, few_policies_objective(measure, n_trials), n_trials)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors


def test_two_workers_on_one_storage_never_measure_a_policy_twice(tmp_path):
    measure = RecordingMeasure(delay_s=0.05)
    settings, _ = new_study(tmp_path)
    run_two_workers(settings, measure, 6)
    # No policy twice. The budget is checked before each trial, so two workers that both see
    # 5 counted may both start one more (as with Optuna's own MaxTrialsCallback): 6 or 7.
    assert len(measure.policies) == len(set(measure.policies)) in (6, 7)
    assert set(measure.policies) <= DISTINCT
    _, study = new_study(tmp_path)
    assert len(trial_records(study)) == len(measure.policies)


def test_two_workers_never_both_claim_one_queued_trial(tmp_path):
    # SQLite ignores the FOR UPDATE with which Optuna claims a queued trial: without write-locking
    # transactions both workers read it WAITING, both measure it, and one crashes reporting it.
    settings, study = new_study(tmp_path)
    every_policy = [
        {"k_dtype_g0": k, "v_dtype_g0": v, "group_size": g}
        for k in ("fp16", "fp8")
        for v in ("fp16", "fp8")
        for g in ((16,) if k == v == "fp16" else (8, 16))
    ]
    for params in every_policy:
        study.enqueue_trial(params)
    measure = RecordingMeasure(delay_s=0.01)
    run_two_workers(settings, measure, len(every_policy))
    assert sorted(measure.policies, key=str) == sorted(DISTINCT, key=str)


def test_repeats_in_an_older_study_are_listed_once(tmp_path):
    settings, study = new_study(tmp_path)
    policy = KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=16)
    metrics, _ = analytic_measure(policy)
    for stored in (policy, policy.replace(scale_dtype="e4m3"), policy, KVPolicy(group_size=8)):
        # Trials 0 and 2 repeat a policy; so do 3 and 4 (fp16 keeps no scales: group size moot).
        study.add_trial(
            optuna.trial.create_trial(
                values=[metrics["accuracy_retention"], metrics["kv_bytes_per_sequence"]],
                user_attrs={"policy": stored.to_dict(), "metrics": metrics},
            )
        )
    study.add_trial(
        optuna.trial.create_trial(
            values=[1.0, 1.0], user_attrs={"policy": KVPolicy(group_size=16).to_dict()}
        )
    )
    records = trial_records(study)
    assert [r.number for r in records] == [0, 1, 3]
    assert records[1].policy.scale_dtype == "e4m3"


def test_engine_presets_are_measured_besides_the_budget_and_queued_once(tmp_path):
    measure = RecordingMeasure()
    settings, study = new_study(tmp_path, engine_presets=("vllm/fp8", "vllm/nvfp4"))
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    enqueue_engine_presets(study, settings.engine_presets)
    presets = engine_presets(ARCH.cached_vector_size)
    objective = TrialObjective(few_policies_space(), measure, OBJECTIVES, Constraints(), 3, presets)
    run_trials(study, objective, 3)
    records = {r.warm_start: r for r in trial_records(study)}
    base = few_policies_space().policy({})
    for name in settings.engine_presets:
        expected = presets[name].replace(block_size=base.block_size, chunk_size=base.chunk_size)
        assert records[name].policy == expected and records[name].complete
    assert ("fp8", "fp8", "tensor") in measure.policies and ("fp4", "fp4") in measure.policies
    trials = study.get_trials()
    assert sum(counted(t) for t in trials) == 3 and len(measure.policies) == 5
    enqueue_engine_presets(study, settings.engine_presets)  # a rerun queues nothing again
    assert len(study.get_trials()) == len(trials)


def test_unknown_engine_preset_is_refused_naming_the_field_and_the_choices(tmp_path):
    refusal = r"study\.engine_presets='vllm/fp9' is invalid: names from .*vllm/nvfp4"
    with pytest.raises(ConfigError, match=refusal):
        new_study(tmp_path, engine_presets=["vllm/fp9"])
