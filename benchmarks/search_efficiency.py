"""How fast does each sampler find good trade-offs, on the objective the studies use? (issue 40
item 5)

Builds the study `kvtune tune` would build from the same overrides (model, workload, search
space with selection, the profiles it derives from, min_retention) and runs it once per sampler
and seed through the study's own trial loop (kvtune/autotune/study/optuna_study.py: the derived
warm starts first, duplicates refused, the budget counting distinct policies). Each trial is
measured as a study measures it, accuracy retention on the workload's suite
(TrialEvaluator.accuracy, in the evaluations cache a study reads) and KV bytes of one sequence
at the workload's context; TPOT, the studies' third objective, is left out: it is timed on a
shared CPU and would make the hypervolume depend on the load. Studies live in memory: a seeded
sampler given the same values proposes the same policies, so a rerun replays every cached
measurement and measures only what an interrupted run did not reach.

Hypervolume of the feasible points (retention >= min_retention), in the box from (retention 1,
bytes 0) to (min_retention, fp16's bytes), scaled to that box (1.0 = one policy at fp16's
retention and no bytes), after 10, 20 and 40 trials: mean ± sample standard deviation over the
seeds for each sampler, and whether the study's default sampler beats random search by more
than the larger of their standard deviations.

    .venv/bin/python -m benchmarks.search_efficiency [--trials 40] [--seeds 0,1,2]
        [--samplers random,tpe,nsga2,gp] [--markdown] [-- model=... workload=... search=...]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

import numpy as np
import optuna
from hydra import compose, initialize_config_dir
from rich.console import Console

from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.cli.main import CONF_DIR
from kvtune.autotune.search.space import SearchSpace
from kvtune.autotune.study.objectives import TrialEvaluator, capacity_metrics, directions
from kvtune.autotune.study.optuna_study import (
    StudySettings,
    TrialObjective,
    counted,
    enqueue_warm_starts,
    make_sampler,
    run_trials,
)
from kvtune.autotune.study.recipe import TuneSetup, build_setup, recipe_from_config
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy

SAMPLERS = ("random", "tpe", "nsga2", "gp")
MARKS = (10, 20, 40)
OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence")


def hypervolume(points: Sequence[tuple[float, float]], reference: tuple[float, float]) -> float:
    """Area dominated by 2-D minimization points inside the box below `reference`."""
    inside = sorted(p for p in points if p[0] < reference[0] and p[1] < reference[1])
    front: list[tuple[float, float]] = []
    for x, y in inside:  # ascending x: keep the points that improve y
        if not front or y < front[-1][1]:
            front.append((x, y))
    area = 0.0
    for index, (x, y) in enumerate(front):
        next_x = front[index + 1][0] if index + 1 < len(front) else reference[0]
        area += (next_x - x) * (reference[1] - y)
    return area


class StudyMeasure:
    """A trial's measurement without its timing: accuracy (cached) and the byte arithmetic."""

    def __init__(self, setup: TuneSetup, cache: JsonCache) -> None:
        self.setup = setup
        self.evaluator = TrialEvaluator(setup.trial_context(), cache)
        self.fresh = 0
        self.seconds = 0.0

    def __call__(self, policy: KVPolicy) -> tuple[dict[str, float], bool]:
        started = time.perf_counter()
        accuracy, cached = self.evaluator.accuracy(policy)
        if not cached:
            self.fresh += 1
            self.seconds += time.perf_counter() - started
        setup = self.setup
        arithmetic = capacity_metrics(setup.arch, policy, setup.device, setup.serve, setup.workload)
        return {**accuracy, **arithmetic}, cached


def study_curve(
    sampler: str,
    seed: int,
    trials: int,
    setup: TuneSetup,
    space: SearchSpace,
    measure: StudyMeasure,
) -> list[float]:
    """Scaled hypervolume after each counted trial of one seeded in-memory study."""
    settings = StudySettings(name=f"{sampler}-{seed}", sampler=sampler, seed=seed)
    study = optuna.create_study(directions=directions(OBJECTIVES))
    study.sampler = make_sampler(settings, space, seed)
    enqueue_warm_starts(study, space, trials)
    objective = TrialObjective(space, measure, OBJECTIVES, setup.constraints, trials)
    run_trials(study, objective, trials)
    minimum = setup.constraints.min_retention
    assert minimum is not None
    context = setup.workload.context_len
    fp16 = kv_bytes_per_sequence(setup.arch, space.policy(space.warm_starts()["baseline"]), context)
    points, curve = [], []
    for trial in study.get_trials(deepcopy=False):
        if not counted(trial):
            continue
        metrics = trial.user_attrs.get("metrics")
        if metrics and metrics["accuracy_retention"] >= minimum:
            shortfall = (1.0 - metrics["accuracy_retention"]) / (1.0 - minimum)
            points.append((shortfall, metrics["kv_bytes_per_sequence"] / fp16))
        curve.append(hypervolume(points, (1.0, 1.0)))
    return curve


def spread(values: np.ndarray) -> str:
    """Mean ± sample standard deviation over seeds (the mean alone for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{values.mean():.4f} ± {values.std(ddof=1):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=max(MARKS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("overrides", nargs="*", help="kvtune tune overrides")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("tune", args.overrides)
    setup = build_setup(recipe_from_config(cfg, args.overrides))
    space = setup.search_space(JsonCache(default_cache_folder("profiles")))
    measure = StudyMeasure(setup, JsonCache(default_cache_folder("evaluations")))
    seeds = [int(s) for s in args.seeds.split(",")]
    console = Console(stderr=True)
    curves = {}
    for sampler in args.samplers.split(","):
        runs = []
        for seed in seeds:
            runs.append(study_curve(sampler, seed, args.trials, setup, space, measure))
            console.print(f"{sampler} seed {seed}: HV {runs[-1][-1]:.4f} ({measure.fresh} new)")
        curves[sampler] = np.array(runs)
    marks = [m for m in MARKS if m <= args.trials]
    rows = [[name, *(spread(runs[:, m - 1]) for m in marks)] for name, runs in curves.items()]
    print(
        f"{setup.model}, {setup.workload.name} workload on {setup.suite['name']}, "
        f"min_retention {setup.constraints.min_retention}; seeds {args.seeds}; "
        f"{measure.fresh} policies measured this run "
        f"({measure.seconds / max(measure.fresh, 1):.0f} s each), "
        f"{time.perf_counter() - started:.0f} s in all\n"
    )
    print_rows(["sampler", *(f"HV@{m}" for m in marks)], rows, args.markdown, Console(width=160))
    default = str(cfg.study.sampler)  # what `kvtune tune` samples with
    if "random" in curves and default in curves and len(seeds) > 1:
        for mark in marks:
            ours, chance = curves[default][:, mark - 1], curves["random"][:, mark - 1]
            margin = max(ours.std(ddof=1), chance.std(ddof=1))
            verdict = "beats" if ours.mean() - chance.mean() > margin else "does not beat"
            print(
                f"\nat {mark} trials {default} {verdict} random by more than one sd ({margin:.4f})"
            )


if __name__ == "__main__":
    main()
