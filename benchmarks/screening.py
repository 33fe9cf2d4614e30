"""Does a cheap suite rank policies as the study's suite does? (issue 40 item 4)

Builds the study `kvtune tune` would build from the same overrides (model, workload, search
space, profiles, the screen preset as screen.suite), takes the space's warm starts and --draws
seeded random draws of distinct policies, and scores each on the screening suite and on the
study's own suite through the trial's accuracy measurement (kvtune/autotune/study/objectives.py),
so every number lands in the evaluations cache a study reads and an interrupted run resumes
where it stopped. Screens come first: a partial run still gives the whole screening column.

Reports each policy's retention on both suites and what each cost, Spearman's and Kendall's
rank correlation between the two, and for each margin what the study's screen
(kvtune/autotune/study/screening.py) would have done to the draws (warm starts skip it): draws
screened out, feasible ones lost (retention >= min_retention on the full suite yet screened
out) and full-suite seconds saved, gross and net of what screening every draw cost.

    .venv/bin/python -m benchmarks.screening [--draws 10] [--seed 0] [--margins 0.02,0.05,0.1]
        [--markdown] [-- model=... workload=... search=... screen.suite=quick-screen]
"""

from __future__ import annotations

import argparse
import random
import sys

from hydra import compose, initialize_config_dir
from rich.console import Console
from scipy import stats

from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.cli.main import CONF_DIR
from kvtune.autotune.study.objectives import TrialEvaluator
from kvtune.autotune.study.optuna_study import policy_key
from kvtune.autotune.study.recipe import build_setup, recipe_from_config
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy

DEFAULT_OVERRIDES = ("screen.suite=quick-screen",)


def candidates(space, draws: int, seed: int) -> dict[str, KVPolicy]:
    """The space's warm starts, then `draws` seeded random draws of policies not seen yet."""
    policies = {name: space.policy(params) for name, params in space.warm_starts().items()}
    seen = {policy_key(p) for p in policies.values()}
    choices = {name: dist.choices for name, dist in space.distributions().items()}
    rng = random.Random(seed)
    while len(policies) < len(space.warm_starts()) + draws:
        policy = space.policy({name: rng.choice(values) for name, values in choices.items()})
        if policy_key(policy) not in seen:
            seen.add(policy_key(policy))
            policies[f"draw {len(policies) - len(space.warm_starts())}"] = policy
    return policies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--margins", default="0.02,0.05,0.1")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("overrides", nargs="*", help="kvtune tune overrides")
    args = parser.parse_args()
    overrides = [*DEFAULT_OVERRIDES, *args.overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        recipe = recipe_from_config(compose("tune", overrides), overrides)
    setup = build_setup(recipe)
    evaluations = JsonCache(default_cache_folder("evaluations"))
    space = setup.search_space(JsonCache(default_cache_folder("profiles")))
    screen = setup.screen(evaluations)
    if screen is None:
        sys.exit("benchmarks.screening: give screen.suite=<preset>")
    full = TrialEvaluator(setup.trial_context(), evaluations)
    policies = candidates(space, args.draws, args.seed)
    context = setup.workload.context_len
    fp16 = kv_bytes_per_sequence(setup.arch, space.policy(space.warm_starts()["baseline"]), context)
    console = Console(stderr=True)
    looks = {}
    for name, policy in policies.items():
        looks[name] = screen(policy)
        console.print(f"screen {name}: {looks[name].retention:.3f} ({looks[name].seconds:.0f} s)")
    scores = {}
    for name, policy in policies.items():
        scores[name] = full.accuracy(policy)[0]
        console.print(f"full {name}: {scores[name]['accuracy_retention']:.3f}")

    names = list(policies)
    cheap = [looks[n].retention for n in names]
    whole = [scores[n]["accuracy_retention"] for n in names]
    rows = [
        [
            name,
            f"{kv_bytes_per_sequence(setup.arch, policies[name], context) / fp16:.3f}",
            f"{looks[name].retention:.3f}",
            f"{scores[name]['accuracy_retention']:.3f}",
            f"{looks[name].seconds:.0f}",
            f"{scores[name]['eval_seconds']:.0f}",
        ]
        for name in names
    ]
    headers = ["policy", "bytes / fp16", "screen retention", "full retention", "screen s", "full s"]
    print(f"{setup.model}, {setup.suite['name']} screened by {setup.screen_suite['name']}:")
    print_rows(headers, rows, args.markdown, console=Console())
    rho, tau = stats.spearmanr(cheap, whole)[0], stats.kendalltau(cheap, whole)[0]
    print(f"\n{len(names)} policies: Spearman {rho:.3f}, Kendall {tau:.3f}\n")
    minimum = setup.constraints.min_retention
    # A study screens drawn policies only (warm starts are chosen): costs and savings are theirs.
    drawn = names[len(space.warm_starts()) :]
    spent = sum(looks[n].seconds for n in drawn)
    total = sum(scores[n]["eval_seconds"] for n in drawn)
    margin_rows = []
    for margin in (float(m) for m in args.margins.split(",")):
        out = [n for n in drawn if looks[n].retention < minimum - margin]
        lost = [n for n in out if scores[n]["accuracy_retention"] >= minimum]
        saved = sum(scores[n]["eval_seconds"] for n in out)
        margin_rows.append(
            [
                f"{margin:.2f}",
                str(len(out)),
                ", ".join(lost) or "none",
                f"{saved / total:.2f}",
                f"{(saved - spent) / total:.2f}",
            ]
        )
    headers = [
        "margin",
        f"draws screened out (of {len(drawn)})",
        f"lost (full >= {minimum})",
        "full s saved / draws' full s",
        "net of the draws' screens",
    ]
    print_rows(headers, margin_rows, args.markdown, console=Console())


if __name__ == "__main__":
    main()
