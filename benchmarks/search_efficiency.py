"""How fast does each sampler find good trade-offs? Hypervolume against trials, against random.

Every sampler searches the default CPU space (conf/search/default.yaml, layers grouped by the
measured fp4 sensitivity) for two objectives measured on the real embedded model: the mean KL
divergence of next-token distributions against the exact cache over held-out Wikipedia prose
(the fidelity signal behind accuracy retention; minimize) and KV bytes of one sequence at the
passage's length relative to fp16 (the shared byte arithmetic; minimize). The passage spans
--chunks prefill chunks of the space's largest chunk_size (default 4), so later chunks read
earlier ones from the quantized, compressed cache and recent windows and compressed sparse
attention change what is scored (a passage inside one chunk scores them at KL ~0 while their
byte savings count). Each distinct canonical policy is measured once and cached on disk by
content (model files, passage tokens, policy, runtime, code), so every sampler and seed reuses it.

Reported per sampler: the hypervolume after 10, 20, 30, 60 and 90 trials, mean and standard
deviation over the seeds, and the first trial count at which the mean curve reaches random
search's final mean hypervolume (target: 30 or fewer for tpe, nsga2 and gp). Random search
runs --trials; the model-based samplers run --model-trials (default 30: the target's budget).
Hypervolume is the dominated area up to the reference point (bytes 1.0 = fp16, KL = --kl-ref).
--chunk-sizes replaces the space's chunk_size candidates: prefill shows each position the cache
decode would, so the chunk size does not change the KL, and a smaller one keeps a passage of
4 chunks cheap on a CPU.

    .venv/bin/python -m benchmarks.search_efficiency [--trials 60] [--model-trials 30]
        [--seeds 0,1,2] [--chunks 4] [--chunk-sizes 64] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import optuna
import yaml
from rich.console import Console
from rich.table import Table

from kvtune.autotune.cache import JsonCache, code_key, default_cache_folder
from kvtune.autotune.evaluation import haystack
from kvtune.autotune.search.sensitivity import (
    SENSITIVITY_CODE,
    RuntimeSettings,
    exact_runtime,
    group_layers,
    layer_sensitivity,
    mean_kl,
)
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.optuna_study import StudySettings, make_sampler
from kvtune.runtime.arch import ModelArch, arch_from_folder
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy, canonical
from kvtune.runtime.tokenizer import Tokenizer

MODEL = "smollm2-135m"
SAMPLERS = ("random", "tpe", "nsga2", "gp")
CHECKPOINTS = (10, 20, 30, 60, 90)
SEARCH_FILE = Path(__file__).resolve().parent.parent / "conf" / "search" / "default.yaml"
PASSAGE_SEED = "search-efficiency"


def passage_ids(tokenizer: Tokenizer, tokens: int) -> list[int]:
    """`tokens` token ids of held-out Wikipedia paragraphs (seeded draw, never in a haystack)."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    pool = haystack.held_out_paragraphs()
    paragraphs = haystack.fill(random.Random(PASSAGE_SEED), pool, tokens + 64, count)
    ids = tokenizer.encode("\n\n".join(paragraphs))
    if len(ids) < tokens:
        raise ValueError(f"the passage has {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def fidelity_key(
    model_hash: str, ids: Sequence[int], policy: KVPolicy, runtime: RuntimeSettings
) -> dict:
    """Content only: model files, passage tokens, canonical policy, runtime and the KL code."""
    return {
        "kind": "search-efficiency",
        "model": model_hash,
        "passage": hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16],
        "policy": canonical(policy).to_dict(),
        "runtime": vars(runtime),
        "code": code_key(*SENSITIVITY_CODE),
    }


class FidelityOracle:
    """KL against the exact cache over the passage, one real prefill per new canonical policy."""

    def __init__(self, runtime: RuntimeSettings, cache: JsonCache, tokens: int) -> None:
        self.runtime = runtime
        self.cache = cache
        folder = resolve_model(MODEL)
        self.model_hash = model_fingerprint(folder)
        self.ids = passage_ids(Tokenizer.from_folder(folder), tokens)
        self.exact = exact_runtime(MODEL, runtime, len(self.ids))
        self.reference = self.exact.prompt_logits(self.ids)
        self.measured = 0
        self.seconds = 0.0  # spent measuring new policies

    def kl(self, policy: KVPolicy) -> float:
        key = fidelity_key(self.model_hash, self.ids, policy, self.runtime)
        cached = self.cache.get(key)
        if cached is not None:
            return float(cached["kl"])
        started = time.perf_counter()
        logits = self.exact.with_policy(policy).prompt_logits(self.ids)
        value = mean_kl(self.reference, logits)
        self.cache.put(key, {"kl": value})
        self.measured += 1
        self.seconds += time.perf_counter() - started
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
    tokens = len(oracle.ids)
    fp16 = kv_bytes_per_sequence(arch, KVPolicy(k_dtype="fp16", v_dtype="fp16"), tokens)
    settings = StudySettings(name=f"{name}-{seed}", sampler=name, seed=seed)
    study = optuna.create_study(directions=["minimize", "minimize"])
    study.sampler = make_sampler(settings, space, seed)
    points: list[tuple[float, float]] = []
    curve: list[float] = []

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        policy = space.suggest(trial)
        point = (oracle.kl(policy), kv_bytes_per_sequence(arch, policy, tokens) / fp16)
        points.append((point[1], point[0]))
        curve.append(hypervolume(points, reference))
        return point

    study.optimize(objective, n_trials=trials)
    return curve


def first_reaching(curve: Sequence[float], target: float) -> int | None:
    return next((i + 1 for i, value in enumerate(curve) if value >= target), None)


def spread(values: np.ndarray) -> str:
    """Mean ± sample standard deviation over seeds (the mean alone for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{values.mean():.4f} ± {values.std(ddof=1):.4f}"


def summary_rows(
    curves: dict[str, np.ndarray], marks: Sequence[int], target: float
) -> list[list[str]]:
    """Per sampler ([seeds, trials] hypervolumes): the spread at each mark, and the first trial
    at which the mean curve reaches target (">N" when it never does)."""
    rows = []
    for name, runs in curves.items():
        cells = [spread(runs[:, m - 1]) if m <= runs.shape[1] else "-" for m in marks]
        reached = first_reaching(runs.mean(axis=0), target)
        rows.append([name, *cells, str(reached) if reached is not None else f">{runs.shape[1]}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=60, help="random search's trials")
    parser.add_argument("--model-trials", type=int, default=30, help="tpe/nsga2/gp trials")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument(
        "--chunks", type=int, default=4, help="passage length in largest prefill chunks"
    )
    parser.add_argument(
        "--chunk-sizes", default=None, help="comma-separated chunk_size candidates for the space"
    )
    parser.add_argument("--kl-ref", type=float, default=0.5, help="reference KL (nats/token)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    runtime = RuntimeSettings()
    folder = resolve_model(MODEL)
    arch = arch_from_folder(folder)
    search = yaml.safe_load(SEARCH_FILE.read_text())
    if args.chunk_sizes:
        search["chunk_size"] = [int(size) for size in args.chunk_sizes.split(",")]
    config = SearchConfig.from_dict(search, arch)
    profile = layer_sensitivity(
        MODEL, folder, arch, runtime, JsonCache(default_cache_folder("sensitivity"))
    )
    groups = group_layers(profile.scores, config.num_groups(arch.num_layers))
    space = SearchSpace(config, groups, arch.num_layers)
    tokens = args.chunks * max(config.knobs["chunk_size"])
    cache = JsonCache(default_cache_folder("search-efficiency"))
    oracle = FidelityOracle(runtime, cache, tokens)
    reference = (1.0, args.kl_ref)
    seeds = [int(s) for s in args.seeds.split(",")]
    curves = {}
    for name in args.samplers.split(","):
        trials = args.trials if name == "random" else args.model_trials
        runs = [run_sampler(name, s, trials, space, arch, oracle, reference) for s in seeds]
        curves[name] = np.array(runs)
    target = float(curves["random"].mean(axis=0)[-1]) if "random" in curves else math.nan
    longest = max(args.trials, args.model_trials)
    marks = sorted({c for c in CHECKPOINTS if c <= longest} | {args.trials, args.model_trials})
    header = ["sampler", *(f"HV@{m}" for m in marks), f"trials to random's HV@{args.trials}"]
    rows = summary_rows(curves, marks, target)
    title = (
        f"Hypervolume (KL over {tokens} tokens vs KV bytes, ref bytes 1.0 / KL {args.kl_ref}) "
        f"on {MODEL}, mean ± sd over seeds {args.seeds}; {oracle.measured} policies measured "
        f"this run ({oracle.seconds / max(oracle.measured, 1):.1f} s each), "
        f"{time.perf_counter() - started:.0f} s in all, load average {os.getloadavg()[0]:.1f}"
    )
    if args.markdown:
        print(title + "\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column == "sampler" else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
