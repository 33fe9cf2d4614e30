"""How fast does each sampler find good trade-offs? Hypervolume against trials, against random.

Every sampler searches the default CPU space (conf/search/default.yaml, layers grouped by the
measured fp4 sensitivity) for two objectives measured on the real embedded model: the mean KL
divergence of next-token distributions against the exact cache over a fixed prose passage
(the fidelity signal behind accuracy retention; minimize) and KV bytes of one sequence at the
passage's length relative to fp16 (the shared byte arithmetic; minimize). Each distinct
canonical policy is measured once and cached on disk, so every sampler and seed reuses it.

Reported per sampler: the mean hypervolume after 10, 20, 30, 60 and 90 trials over the seeds,
and the first trial count at which it reaches random search's 90-trial hypervolume (target: 30
or fewer for tpe, nsga2 and gp). Random search runs --trials; the model-based samplers run
--model-trials (default 30: the target's budget; more shows their later curve). Hypervolume
is the dominated area up to the reference point (bytes 1.0 = fp16, KL = --kl-ref).

    .venv/bin/python -m benchmarks.search_efficiency [--trials 90] [--model-trials 30]
        [--seeds 0,1,2] [--markdown]
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import optuna
import yaml
from rich.console import Console
from rich.table import Table

from autotune.cache import JsonCache, default_cache_folder, model_fingerprint
from autotune.search.sensitivity import (
    RuntimeSettings,
    exact_runtime,
    group_layers,
    layer_sensitivity,
    mean_kl,
)
from autotune.search.space import SearchConfig, SearchSpace, canonical
from autotune.study.optuna_study import StudySettings, make_sampler
from runtime.arch import ModelArch, arch_from_folder
from runtime.kv_bytes import kv_bytes_per_sequence
from runtime.model_source import resolve_model
from runtime.policy import KVPolicy
from runtime.tokenizer import Tokenizer

MODEL = "smollm2-135m"
SAMPLERS = ("random", "tpe", "nsga2", "gp")
CHECKPOINTS = (10, 20, 30, 60, 90)
SEARCH_FILE = Path(__file__).resolve().parent.parent / "conf" / "search" / "default.yaml"
PASSAGE_TOKENS = 160
PASSAGE = (
    "The river rises in a bog on the northern slope of the mountain, at about 1,240 metres, "
    "and flows south-east for 212 kilometres before it joins the sea near the old harbour "
    "town. Its valley was settled early: stone tools found near the third bridge are dated "
    "to around 4,500 years ago, and a Roman road followed the eastern bank. In the middle "
    "ages the river drove eleven mills, of which two still stand; the larger, built in 1388, "
    "ground grain until 1951 and is now a museum. Floods are frequent in spring, when snow "
    "melts on the upper slopes; the worst on record, in March 1872, carried away four "
    "bridges and drowned 37 people. Since 1964 a dam above the gorge has held back a "
    "reservoir of 48 million cubic metres that supplies drinking water to the capital and "
    "generates about 90 gigawatt-hours of electricity a year. The lower river is rich in "
    "trout and salmon, and its estuary is a protected area for wading birds, among them "
    "the curlew, the redshank and the rare spoonbill, which returned in 2009 after an "
    "absence of more than a century. A long-distance footpath follows the river from its "
    "source to the sea; walkers usually take eight to ten days, staying in villages whose "
    "inns still bear the names of the mills and ferries that once served them. "
)


class FidelityOracle:
    """KL against the exact cache over the passage, one real prefill per new canonical policy."""

    def __init__(self, runtime: RuntimeSettings, cache: JsonCache) -> None:
        self.runtime = runtime
        self.cache = cache
        folder = resolve_model(MODEL)
        self.fingerprint = model_fingerprint(folder)
        ids = Tokenizer.from_folder(folder).encode(PASSAGE * 3)
        self.ids = ids[:PASSAGE_TOKENS]
        self.exact = exact_runtime(MODEL, runtime, len(self.ids))
        self.reference = self.exact.prompt_logits(self.ids)
        self.measured = 0

    def kl(self, policy: KVPolicy) -> float:
        key = {
            "kind": "search-efficiency",
            "model": self.fingerprint,
            "policy": canonical(policy).to_dict(),
            "tokens": len(self.ids),
            "runtime": vars(self.runtime),
        }
        cached = self.cache.get(key)
        if cached is not None:
            return float(cached["kl"])
        logits = self.exact.with_policy(policy).prompt_logits(self.ids)
        value = mean_kl(self.reference, logits)
        self.cache.put(key, {"kl": value})
        self.measured += 1
        return value


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


def run_sampler(
    name: str,
    seed: int,
    trials: int,
    space: SearchSpace,
    arch: ModelArch,
    oracle: FidelityOracle,
    reference: tuple[float, float],
) -> list[float]:
    """Hypervolume after each trial of one seeded study (in memory; measurements cached)."""
    fp16 = kv_bytes_per_sequence(arch, KVPolicy(k_dtype="fp16", v_dtype="fp16"), PASSAGE_TOKENS)
    settings = StudySettings(name=f"{name}-{seed}", sampler=name, seed=seed)
    study = optuna.create_study(directions=["minimize", "minimize"])
    study.sampler = make_sampler(settings, space, seed)
    points: list[tuple[float, float]] = []
    curve: list[float] = []

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        policy = space.suggest(trial)
        point = (oracle.kl(policy), kv_bytes_per_sequence(arch, policy, PASSAGE_TOKENS) / fp16)
        points.append((point[1], point[0]))
        curve.append(hypervolume(points, reference))
        return point

    study.optimize(objective, n_trials=trials)
    return curve


def first_reaching(curve: Sequence[float], target: float) -> int | None:
    return next((i + 1 for i, value in enumerate(curve) if value >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=90, help="random search's trials")
    parser.add_argument("--model-trials", type=int, default=30, help="tpe/nsga2/gp trials")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--kl-ref", type=float, default=0.5, help="reference KL (nats/token)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    runtime = RuntimeSettings()
    folder = resolve_model(MODEL)
    arch = arch_from_folder(folder)
    config = SearchConfig.from_dict(yaml.safe_load(SEARCH_FILE.read_text()), arch)
    profile = layer_sensitivity(
        MODEL, folder, arch, runtime, JsonCache(default_cache_folder("sensitivity"))
    )
    groups = group_layers(profile.scores, config.num_groups(arch.num_layers))
    space = SearchSpace(config, groups, arch.num_layers)
    oracle = FidelityOracle(runtime, JsonCache(default_cache_folder("search-efficiency")))
    reference = (1.0, args.kl_ref)
    seeds = [int(s) for s in args.seeds.split(",")]
    samplers = args.samplers.split(",")
    curves = {}
    for name in samplers:
        trials = args.trials if name == "random" else args.model_trials
        runs = [run_sampler(name, s, trials, space, arch, oracle, reference) for s in seeds]
        curves[name] = np.array(runs).mean(axis=0)
    target = float(curves["random"][-1]) if "random" in curves else math.nan
    table = Table(
        title=f"Hypervolume (KL vs KV bytes, ref bytes 1.0 / KL {args.kl_ref}) on {MODEL}, "
        f"mean of seeds {args.seeds}; {oracle.measured} policies measured this run, "
        f"{time.perf_counter() - started:.0f} s"
    )
    table.add_column("sampler")
    marks = [c for c in CHECKPOINTS if c <= args.trials]
    for mark in marks:
        table.add_column(f"HV@{mark}", justify="right")
    table.add_column(f"trials to random's HV@{args.trials}", justify="right")
    for name, curve in curves.items():
        reached = first_reaching(curve, target)
        table.add_row(
            name,
            *(f"{curve[m - 1]:.4f}" if m <= len(curve) else "-" for m in marks),
            str(reached) if reached is not None else f">{len(curve)}",
        )
    Console(width=160).print(table)
    if args.markdown:
        header = ["sampler", *(f"HV@{m}" for m in marks), f"trials to random HV@{args.trials}"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for name, curve in curves.items():
            reached = first_reaching(curve, target)
            cells = [f"{curve[m - 1]:.4f}" if m <= len(curve) else "-" for m in marks]
            print(f"| {name} | " + " | ".join(cells) + f" | {reached or f'>{len(curve)}'} |")


if __name__ == "__main__":
    main()
