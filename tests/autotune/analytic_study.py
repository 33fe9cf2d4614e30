"""A small study on a real SQLite storage with an analytic objective: KV bytes from the real
byte arithmetic and a retention formula (each fp4 stream costs 0.05). What these tests check
is the study machinery (budget, warm starts, failures, resume, tracking, picks), whose outcome
must follow from known objective values; the measured objective (runtime and suite) is tested
end to end by test_tune_cli.py and test_workers_postgres.py."""

import threading
from collections.abc import Callable

import optuna

from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.objectives import Constraints, TrialFailure
from kvtune.autotune.study.optuna_study import (
    StudySettings,
    TrialObjective,
    create_or_resume,
    make_sampler,
    open_storage,
)
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence

ARCH = ModelArch("test", 4, 4, 2, 16, 1 << 20, 4096)
SEARCH = {
    "layer_groups": "all",
    "k_dtype": ["fp16", "fp8", "fp4"],
    "v_dtype": ["fp16", "fp8", "fp4"],
    "group_size": [8, 16],
    "scale_dtype": ["fp16"],
    "recent_unquantized": [0],
    "csa_ratio": [1, 2],
    "csa_window": [32],
    "csa_sinks": [4],
    "block_size": [16],
    "chunk_size": [64],
}
OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence")
RECIPE = {"model": {"name": "test"}, "objectives": list(OBJECTIVES)}


def search_space() -> SearchSpace:
    config = SearchConfig.from_dict(SEARCH, ARCH)
    return SearchSpace(config, tuple((i,) for i in range(4)), 4)


def analytic_measure(policy):
    """Retention drops 0.05 per fp4 stream; KV bytes from the real arithmetic."""
    fp4 = sum(d == "fp4" for pair in policy.layer_pairs(4) for d in pair)
    metrics = {
        "accuracy_retention": 1.0 - 0.05 * fp4,
        "kv_bytes_per_sequence": float(kv_bytes_per_sequence(ARCH, policy, 512)),
    }
    return metrics, False


def refuse_compression(policy):
    if policy.compressed:
        raise TrialFailure("invalid combination: compression refused in this test")
    return analytic_measure(policy)


def new_study(tmp_path, name="s", **settings) -> tuple[StudySettings, optuna.Study]:
    study_settings = StudySettings(
        name=name, storage=f"sqlite:///{tmp_path / 'optuna.db'}", **settings
    )
    storage = open_storage(study_settings)
    study = create_or_resume(study_settings, storage, RECIPE, OBJECTIVES)
    # Seeded, so that which trials a test sees never depends on chance.
    study.sampler = make_sampler(study_settings, search_space(), study_settings.seed)
    return study_settings, study


def objective(measure=analytic_measure, n_trials=6, min_retention=None):
    return TrialObjective(
        search_space(), measure, OBJECTIVES, Constraints(min_retention=min_retention), n_trials
    )


def finishes(run: Callable[[], None], seconds: float = 120) -> bool:
    """Whether run() (a study loop) returns within `seconds`; a daemon thread, so a study that
    loops forever fails its test instead of hanging the suite."""
    finished = threading.Event()

    def target() -> None:
        run()
        finished.set()

    threading.Thread(target=target, daemon=True).start()
    return finished.wait(timeout=seconds)
