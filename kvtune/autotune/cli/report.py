"""What `kvtune tune` shows people: a progress bar per study and the final Pareto table."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import optuna
from optuna.trial import FrozenTrial
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtune.autotune.study.optuna_study import (
    DUPLICATE_ATTR,
    active,
    screened_out,
    trial_reason,
)
from kvtune.autotune.study.results import TrialRecord
from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES

MIB = 1 << 20


def study_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
    )


def finished_trials(study: optuna.Study) -> int:
    """Trials of the budget and engine presets that are done (all workers; screened-out ones
    are outside both)."""
    trials = study.get_trials(deepcopy=False)
    return sum(active(t) and t.state.is_finished() and not screened_out(t) for t in trials)


def trial_summary(trial: FrozenTrial) -> str:
    """One trial in a few words: its headline metrics, else its state and why."""
    metrics = trial.user_attrs.get("metrics")
    if metrics:
        shown = [
            f"retention {metrics['accuracy_retention']:.3f}",
            f"{metrics['kv_bytes_per_sequence'] / MIB:.2f} MiB/seq",
        ]
        if "tpot_ms" in metrics:
            shown.append(f"tpot {metrics['tpot_ms']:.1f} ms")
        return f"trial {trial.number}: {', '.join(shown)}"
    if DUPLICATE_ATTR in trial.user_attrs:
        return f"trial {trial.number}: skipped, policy of trial {trial.user_attrs[DUPLICATE_ATTR]}"
    reason = trial_reason(trial)
    return f"trial {trial.number}: {trial.state.name}" + (f" ({reason})" if reason else "")


class ProgressCallback:
    """Optuna callback advancing the bar to the study's finished trials (all workers)."""

    def __init__(self, progress: Progress, study: optuna.Study, n_trials: int) -> None:
        self.progress = progress
        self.task = progress.add_task(
            study.study_name, total=n_trials, completed=finished_trials(study), last=""
        )

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.progress.update(self.task, completed=finished_trials(study), last=trial_summary(trial))


class TrialLines:
    """Optuna callback printing one plain line per trial, for output that is not a terminal
    (a file, a pipe, a CI log), where a live bar would be cut to the console width."""

    def __init__(self, console: Console, n_trials: int) -> None:
        self.console = console
        self.n_trials = n_trials

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        done = f"[{finished_trials(study)}/{self.n_trials}]"
        line = f"{study.study_name} {done} {trial_summary(trial)}"
        self.console.out(line, highlight=False)


@contextlib.contextmanager
def trial_reporter(
    console: Console, study: optuna.Study, n_trials: int
) -> Iterator[Callable[[optuna.Study, FrozenTrial], None]]:
    """The per-trial callback: a live bar on a terminal, plain lines anywhere else."""
    if not console.is_terminal:
        yield TrialLines(console, n_trials)
        return
    with study_progress(console) as progress:
        yield ProgressCallback(progress, study, n_trials)


def policy_label(record: TrialRecord, num_layers: int) -> str:
    """Short description of a policy for tables, e.g. "fp8/fp4 x20 fp16/fp16 x10 g16/e4m3
    csa4(s16,w128) b16 c256"."""
    policy = record.policy
    if policy is None:
        return ""
    pairs = ["/".join(pair) for pair in policy.layer_pairs(num_layers)]
    kinds = sorted(set(pairs), key=pairs.index)
    parts = [f"{kind} x{pairs.count(kind)}" for kind in kinds]
    if any(d in QUANTIZED_DTYPES for pair in pairs for d in pair.split("/")):
        parts.append(f"g{policy.group_size}/{policy.scale_dtype}")
        if policy.k_group_size is not None:
            parts.append(f"K-g{policy.k_group_size}")
        if policy.k_scale_axis != "token":
            parts.append(f"K-{policy.k_scale_axis}")
        if policy.recent_unquantized:
            parts.append(f"recent{policy.recent_unquantized}")
        if policy.rotation != "none":
            parts.append(policy.rotation)
    if policy.compressed:
        pooled = f"csa{policy.csa_ratio}" if policy.summarises else "csa-nosum"
        parts.append(f"{pooled}(s{policy.csa_sinks},w{policy.csa_window})")
    parts.append(f"b{policy.block_size} c{policy.chunk_size}")
    return " ".join(parts)


def _compact(count: float) -> str:
    """1234 -> 1234, 123456 -> 123k, 12345678 -> 12.3M."""
    if count >= 1e6:
        return f"{count / 1e6:.1f}M"
    return f"{count / 1e3:.0f}k" if count >= 1e5 else f"{count:.0f}"


def render_front(
    console: Console,
    study_name: str,
    records: Sequence[TrialRecord],
    front: Sequence[int],
    num_layers: int,
) -> None:
    """The Pareto front as a rich table, best accuracy first, with the study's totals."""
    done = sum(r.complete for r in records)
    failed = sum(r.state == "FAIL" for r in records)
    table = Table(
        title=f"Pareto front of study {study_name}: {len(front)} of {done} complete trials "
        f"({failed} failed)"
    )
    table.caption = "retention: fraction of the baseline; latencies in ms (measured); seqs: "
    table.caption += "sequences of the workload's context that fit on the target device"
    for name in ("trial", "retention", "MiB/seq", "tpot", "ttft", "p99", "seqs"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("policy", overflow="fold")
    rows = sorted(
        (r for r in records if r.number in front),
        key=lambda r: -r.metrics["accuracy_retention"],
    )
    for r in rows:
        m = r.metrics
        table.add_row(
            str(r.number),
            f"{m['accuracy_retention']:.3f}",
            f"{m['kv_bytes_per_sequence'] / MIB:,.3f}",
            f"{m['tpot_ms']:.1f}",
            f"{m['ttft_ms']:.0f}",
            f"{m['p99_latency_ms']:.0f}",
            _compact(m["max_num_seqs"]),
            policy_label(r, num_layers),
        )
    console.print(table)
