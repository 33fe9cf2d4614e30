"""Cheap first looks (kvtune/autotune/study/screening.py): a drawn policy passes a cheaper suite
before it costs the full one.

The study tests run on a real SQLite storage with tests/autotune/analytic_study.py's formula as
both the screen and the full measurement, so which policies the screen must reject follows from
each policy's dtypes, counted here; the presets are checked against their YAML files."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from optuna.trial import TrialState

from kvtune.autotune.cli.main import CONF_DIR
from kvtune.autotune.study.objectives import Constraints
from kvtune.autotune.study.optuna_study import (
    TrialObjective,
    counted,
    enqueue_warm_starts,
    run_trials,
    screened_out,
)
from kvtune.autotune.study.recipe import build_setup, recipe_from_config
from kvtune.autotune.study.results import trial_records
from kvtune.autotune.study.screening import (
    SCREEN_ATTR,
    SCREENED_OUT_ATTR,
    Screen,
    ScreenSettings,
)
from kvtune.runtime.errors import ConfigError
from tests.autotune.analytic_study import (
    OBJECTIVES,
    analytic_measure,
    finishes,
    new_study,
    search_space,
)

MIN_RETENTION = 0.9
MARGIN = 0.05


def fp4_streams(policy) -> int:
    """The analytic retention's input: K and V streams stored as fp4 over the 4 layers."""
    return sum(dtype == "fp4" for pair in policy.layer_pairs(4) for dtype in pair)


class Recorder:
    """A measurement that remembers the policies it was asked about."""

    def __init__(self, retention=None) -> None:
        self.retention = retention
        self.policies: list[str] = []

    def __call__(self, policy):
        self.policies.append(repr(policy.to_dict()))
        metrics, cached = analytic_measure(policy)
        if self.retention is not None:
            metrics["accuracy_retention"] = self.retention
        return {**metrics, "eval_seconds": 0.0}, cached


def screened_objective(screen_measure, full_measure, n_trials, max_rejected=12):
    settings = ScreenSettings(suite="cheap", margin=MARGIN, max_rejected=max_rejected)
    return TrialObjective(
        search_space(),
        full_measure,
        OBJECTIVES,
        Constraints(min_retention=MIN_RETENTION),
        n_trials,
        screen=Screen(settings, screen_measure, MIN_RETENTION),
    )


def test_a_drawn_policy_below_the_screen_is_pruned_outside_the_budget_never_run_in_full(
    tmp_path,
):
    cheap, full = Recorder(), Recorder()
    settings, study = new_study(tmp_path, n_trials=8)
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    enqueue_warm_starts(study, search_space(), 8)
    run_trials(study, screened_objective(cheap, full, 8), 8)
    trials = study.get_trials()
    space = search_space()

    rejected = [t for t in trials if screened_out(t)]
    assert rejected, "seed 0 draws policies with 4 or more fp4 streams"
    for trial in rejected:
        streams = fp4_streams(space.policy(trial.params))
        retention = 1.0 - 0.05 * streams
        assert retention < MIN_RETENTION - MARGIN
        assert trial.state == TrialState.PRUNED and not counted(trial)
        assert trial.constraints["min_retention"] == pytest.approx(MIN_RETENTION - retention)
        assert f"retention {retention:.3f} on cheap" in trial.user_attrs[SCREENED_OUT_ATTR]
        assert repr(space.policy(trial.params).to_dict()) not in full.policies

    measured = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sum(counted(t) for t in trials) == len(measured) == 8
    for trial in measured:
        if "warm_start" in trial.user_attrs:  # chosen, not drawn: never screened
            assert SCREEN_ATTR not in trial.user_attrs
            continue
        look = trial.user_attrs[SCREEN_ATTR]
        assert look["accuracy_retention"] >= MIN_RETENTION - MARGIN
        assert fp4_streams(space.policy(trial.params)) <= 3
    assert len(full.policies) == len(set(full.policies)) == 8
    assert len(cheap.policies) == len(set(cheap.policies))  # nothing looked at twice

    reasons = {r.number: r.failure_reason for r in trial_records(study)}
    for trial in rejected:
        assert reasons[trial.number].startswith("screened out: retention")


def test_the_study_stops_once_the_screen_has_rejected_its_most(tmp_path):
    settings, study = new_study(tmp_path, n_trials=10)
    study.sampler = optuna.samplers.RandomSampler(seed=1)
    enqueue_warm_starts(study, search_space(), 10)
    full = Recorder()
    objective = screened_objective(Recorder(retention=0.0), full, 10, max_rejected=3)
    assert finishes(lambda: run_trials(study, objective, 10)), (
        "the study kept drawing after the screen's limit"
    )
    trials = study.get_trials()
    assert sum(screened_out(t) for t in trials) == 3
    warm = [t for t in trials if "warm_start" in t.user_attrs]
    assert len(full.policies) == len(warm) == 2  # only the chosen starts ran in full


def test_screen_settings_are_checked_naming_the_field():
    for data, field in (
        ({"margin": 1.5}, "screen.margin"),
        ({"margin": True}, "screen.margin"),
        ({"max_rejected": 0}, "screen.max_rejected"),
        ({"suite": ""}, "screen.suite"),
        ({"sute": "quick-screen"}, "screen.sute"),
    ):
        with pytest.raises(ConfigError) as error:
            ScreenSettings.from_dict(data)
        assert field in str(error.value) and "\n" not in str(error.value)


def tune_recipe(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return recipe_from_config(compose("tune", overrides), overrides)


def test_a_study_stores_its_screen_only_when_it_screens():
    """Studies made before screening stored no screen block and must resume unchanged."""
    assert "screen" not in tune_recipe([])
    recipe = tune_recipe(["screen.suite=quick-screen"])
    assert recipe["screen"]["suite"] == "quick-screen"
    setup = build_setup(recipe)
    assert setup.screen_suite["name"] == "quick-screen"
    assert setup.screen_suite["model"] == setup.suite["model"] == "smollm2-135m"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["screen.suite=nosuch"], ("screen.suite", "nosuch", "quick-screen")),
        (
            ["screen.suite=quick-screen", "constraints.min_retention=null"],
            ("screen.suite", "min_retention"),
        ),
    ],
)
def test_a_screen_the_study_cannot_use_is_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as error:
        build_setup(tune_recipe(overrides))
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words)


def preset(name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / "eval" / f"{name}.yaml").read_text())


def prompt_tokens(suite: dict) -> int:
    """Haystack tokens a suite prefills: each doc once at its task's length."""
    return sum(
        size["docs"] * size.get("context_tokens", suite["context_tokens"])
        for size in suite["tasks"].values()
    )


@pytest.mark.parametrize(
    ("screen", "full"), [("quick-screen", "quick"), ("long8k-screen", "long8k")]
)
def test_a_screen_preset_asks_fewer_of_its_suites_questions_at_the_same_lengths(screen, full):
    """A screen that ran shorter haystacks would judge selection where it reads most of the
    context: same model, seed and lengths, a subset of tasks, no more items, fewer tokens."""
    cheap, whole = preset(screen), preset(full)
    for field in ("model", "seed", "context_tokens", "dtype", "backend"):
        assert cheap[field] == whole[field], field
    for task, size in cheap["tasks"].items():
        assert task in whole["tasks"]
        own = whole["tasks"][task]
        assert size.get("context_tokens") == own.get("context_tokens")
        assert size["docs"] <= own["docs"]
        assert size.get("questions", 1) <= own.get("questions", 1)
    assert prompt_tokens(cheap) <= 0.6 * prompt_tokens(whole)
