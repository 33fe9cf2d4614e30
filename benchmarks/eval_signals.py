"""Which accuracy signal separates policies near the top of the front, and at what cost?

For a suite and a few policies, records per question (per document for perplexity) every
candidate signal, paired with the uncompressed baseline on the same question:

- prob: probability of the gold answer (the suite's headline until 2026-12-02), retention =
  ratio of task means;
- loglik: teacher-forced log-likelihood of the gold answer, retention = exp(mean over
  questions of the policy's minus the baseline's log-likelihood), the answers' perplexity
  ratio;
- kl: KL(baseline || policy) of the next-token distributions at the answer tokens, as
  exp(-mean KL per answer token), so that 1 means identical;
- kl_answer: the same summed over each answer's tokens, exp(-mean over questions): the
  expected teacher-forced likelihood ratio of the whole answer if the gold answer were drawn
  from the baseline's own distribution (loglik with the draw of the gold token averaged out).

Each is averaged over tasks as accuracy_retention is (perplexity documents: baseline / policy
word perplexity for prob and loglik, exp(-KL per token) for kl and kl_answer), and its
standard error is a paired bootstrap that resamples questions within each task. Also reported:
the standard error on the first half and quarter of each task's questions (how it falls with
questions), each pair of policies' difference with the stderr of a bootstrap that resamples
the same questions for both (what separating two policies needs), and wall seconds per
policy. Per-question values are written as JSON (`--out`) and can be summarized again
(`--from-json`).

    .venv/bin/python -m benchmarks.eval_signals --suite quick \
        --policies "fp8 g32,K fp8 / V fp4 g32,fp8 g32 + recent 128" [--out /tmp/signals.json]
    .venv/bin/python -m benchmarks.eval_signals --from-json /tmp/signals.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.eval_validity import POLICIES
from kvtune.autotune.evaluation.baseline_cache import baseline_run
from kvtune.autotune.evaluation.evaluator import eval_cache_dir
from kvtune.autotune.evaluation.fidelity import coarse_kl
from kvtune.autotune.evaluation.suite import load_suite
from kvtune.autotune.evaluation.suite_run import SuiteRun, run_suite
from kvtune.autotune.evaluation.task_files import TaskFolder, task_folder
from kvtune.autotune.evaluation.tasks import QA, TASKS
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

SIGNALS = ("prob", "loglik", "kl", "kl_answer")
ITERS = 1000

# Per task: arrays [questions] for the policy and the baseline (and words for perplexity).
TaskValues = dict[str, np.ndarray]


def _key(task: str, row: dict) -> tuple[str, ...]:
    return (row["text"], "0") if TASKS[task].kind != QA else (row["context"], row["answer"])


def per_question(folder: TaskFolder, baseline: SuiteRun, run: SuiteRun) -> dict[str, TaskValues]:
    """Per task: policy and baseline log-likelihoods (QA: of the gold answer; perplexity: of the
    document, with its word count) and the mean KL at the scored positions, in row order."""
    values = {}
    for task, rows in folder.rows.items():
        policy = np.asarray(run.tasks[task].values, dtype=float)
        base = np.asarray(baseline.tasks[task].values, dtype=float)
        kls, positions = [], []
        for row in rows:
            key = _key(task, row)
            ref, mine = baseline.rows[key], run.rows[key]
            kls.append(float(coarse_kl(ref, mine.at_reference)[ref.num_tail :].mean()))
            positions.append(ref.top_ids.shape[0] - ref.num_tail)
        entry = {"kl": np.asarray(kls), "positions": np.asarray(positions, dtype=float)}
        if TASKS[task].kind == QA:  # values are probabilities of the gold answer
            entry |= {"policy": np.log(policy[:, 0]), "baseline": np.log(base[:, 0])}
        else:  # (log-likelihood, words) per document
            entry |= {"policy": policy[:, 0], "baseline": base[:, 0], "words": policy[:, 1]}
        values[task] = entry
    return values


def task_retention(signal: str, entry: TaskValues, index: np.ndarray) -> np.ndarray:
    """One task's retention under `signal` for each row of resampled indices [iters, n]."""
    if signal == "kl" or (signal == "kl_answer" and "words" in entry):
        return np.exp(-entry["kl"][index].mean(-1))
    if signal == "kl_answer":
        return np.exp(-(entry["kl"] * entry["positions"])[index].mean(-1))
    delta = entry["policy"][index] - entry["baseline"][index]
    if "words" in entry:  # word perplexity ratio: exp(sum delta log-likelihood / sum words)
        return np.exp(delta.sum(-1) / entry["words"][index].sum(-1))
    if signal == "loglik":
        return np.exp(delta.mean(-1))
    return np.exp(entry["policy"][index]).mean(-1) / np.exp(entry["baseline"][index]).mean(-1)


def _draws(
    signal: str, values: dict[str, TaskValues], fraction: float, rng: np.random.Generator
) -> tuple[float, np.ndarray]:
    """(retention, bootstrap draws): the mean over tasks of the signal's retention on the first
    `fraction` of each task's samples (at least 2), and ITERS draws resampling them within each
    task with `rng` (the same rng state gives two policies the same resamples: paired)."""
    point, draws = [], []
    for entry in values.values():
        n = max(2, round(len(entry["kl"]) * fraction))
        point.append(float(task_retention(signal, entry, np.arange(n)[None])[0]))
        draws.append(task_retention(signal, entry, rng.integers(0, n, size=(ITERS, n))))
    return float(np.mean(point)), np.mean(draws, axis=0)


def retention_and_stderr(
    signal: str, values: dict[str, TaskValues], fraction: float = 1.0
) -> tuple[float, float]:
    """Mean over tasks of the signal's retention and its stratified paired bootstrap stderr."""
    value, draws = _draws(signal, values, fraction, np.random.default_rng(0))
    return value, float(draws.std(ddof=1))


def difference(
    signal: str, first: dict[str, TaskValues], second: dict[str, TaskValues]
) -> tuple[float, float]:
    """first's retention minus second's and its stderr, both resampled on the same questions."""
    a, draws_a = _draws(signal, first, 1.0, np.random.default_rng(0))
    b, draws_b = _draws(signal, second, 1.0, np.random.default_rng(0))
    return a - b, float((draws_a - draws_b).std(ddof=1))


def measure(suite_name: str, names: list[str]) -> dict[str, dict]:
    """Run the policies on the suite; per policy its seconds and per-question values."""
    suite = load_suite(suite_name)
    model_folder = resolve_model(suite.model)
    root = eval_cache_dir()
    folder = task_folder(suite, Tokenizer.from_folder(model_folder), root)
    started = time.perf_counter()
    baseline, _ = baseline_run(suite, folder, model_folder, root)
    print(f"baseline: {time.perf_counter() - started:.1f} s (0 when cached)", flush=True)
    dump: dict[str, dict] = {}
    for name in names:
        started = time.perf_counter()
        run = run_suite(POLICIES[name], suite, folder, reference=baseline.rows)
        values = per_question(folder, baseline, run)
        dump[name] = {
            "seconds": time.perf_counter() - started,
            "tasks": {t: {k: v.tolist() for k, v in e.items()} for t, e in values.items()},
        }
        print(f"{name}: {dump[name]['seconds']:.0f} s", flush=True)
    load = os.getloadavg()[0]
    print(f"{suite.name}: torch threads {torch.get_num_threads()}, load average {load:.1f}")
    return dump


def summarize(dump: dict[str, dict]) -> None:
    """Per policy and signal: retention ± stderr on all, half and a quarter of the questions;
    per task retentions; then each pair of policies' difference ± its paired stderr."""
    policies = {
        name: {t: {k: np.asarray(v) for k, v in e.items()} for t, e in entry["tasks"].items()}
        for name, entry in dump.items()
    }
    for name, values in policies.items():
        sizes = ", ".join(f"{task} {len(entry['kl'])}" for task, entry in values.items())
        print(f"{name} ({dump[name]['seconds']:.0f} s; samples: {sizes})")
        for signal in SIGNALS:
            cells = [
                f"{fraction:g}: {v:.4f} ± {e:.4f}"
                for fraction in (1.0, 0.5, 0.25)
                for v, e in [retention_and_stderr(signal, values, fraction)]
            ]
            per_task = ", ".join(
                f"{task} {float(task_retention(signal, e, np.arange(len(e['kl']))[None])[0]):.3f}"
                for task, e in values.items()
            )
            print(f"    {signal:9} {'; '.join(cells)}  [{per_task}]")
    names = list(policies)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            cells = [
                f"{signal} {d:+.4f} ± {e:.4f}"
                for signal in SIGNALS
                for d, e in [difference(signal, policies[first], policies[second])]
            ]
            print(f"{first} - {second}: " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="quick", help="preset name or YAML path")
    parser.add_argument("--policies", default="fp8 g32,K fp8 / V fp4 g32")
    parser.add_argument("--out", type=Path, help="write per-question values here (JSON)")
    parser.add_argument("--from-json", type=Path, help="summarize a written file, run nothing")
    args = parser.parse_args()
    if args.from_json:
        dump = json.loads(args.from_json.read_text())
    else:
        dump = measure(args.suite, [n.strip() for n in args.policies.split(",")])
        if args.out:
            args.out.write_text(json.dumps(dump))
    summarize(dump)


if __name__ == "__main__":
    main()
