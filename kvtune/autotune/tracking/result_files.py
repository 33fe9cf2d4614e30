"""The files that hold a study's results, written into studies/<name>/ at the end of each
`kvtune tune` / `kvtune worker` invocation and logged from there to the invocation's MLflow run.

    trials.csv                     every trial: state, reason, Pareto membership, metrics, policy
    pareto_front.png / .html       the trials and the front (when a trial completed)
    front/trial_<n>.kvtune.yaml    the front's policies
    recipe.yaml                    the recipe stored with the study

Each file is this invocation's: written beside its final name and moved over it (a reader, or a
worker finishing at the same time, never sees half a file), and a file this invocation cannot
write (or has no content for, such as a trial that left the front) is removed rather than left
stale. Every writer raises on error; the caller decides whether an error stops it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtune.autotune.study.results import TrialRecord, write_trials_csv
from kvtune.autotune.tracking.plots import pareto_html, pareto_png

TRIALS_CSV = "trials.csv"
PARETO_PNG = "pareto_front.png"
PARETO_HTML = "pareto_front.html"
FRONT = "front"
RECIPE = "recipe.yaml"


@dataclass(frozen=True)
class StudyResults:
    """What the result files are made of."""

    records: Sequence[TrialRecord]
    front: Sequence[int]
    objectives: Sequence[str]
    num_layers: int
    recipe_yaml: str


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`, with its suffix (plot writers choose the format by it),
    moved over `path` once written; when writing fails, `path` is removed instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        if path.is_file():
            path.unlink()
        raise
    finally:
        temporary.unlink(missing_ok=True)


def write_trials_table(folder: Path, results: StudyResults) -> list[Path]:
    path = folder / TRIALS_CSV
    with replacing(path) as temporary:
        write_trials_csv(results.records, results.front, results.num_layers, temporary)
    return [path]


def _plot(
    folder: Path, name: str, draw: Callable[[Path], None], results: StudyResults
) -> list[Path]:
    path = folder / name
    if not any(r.complete for r in results.records):  # nothing to draw
        path.unlink(missing_ok=True)
        return []
    with replacing(path) as temporary:
        draw(temporary)
    return [path]


def write_pareto_png(folder: Path, results: StudyResults) -> list[Path]:
    def draw(path: Path) -> None:
        pareto_png(results.records, results.front, results.objectives, path)

    return _plot(folder, PARETO_PNG, draw, results)


def write_pareto_html(folder: Path, results: StudyResults) -> list[Path]:
    def draw(path: Path) -> None:
        pareto_html(results.records, results.front, results.objectives, results.num_layers, path)

    return _plot(folder, PARETO_HTML, draw, results)


def write_front_policies(folder: Path, results: StudyResults) -> list[Path]:
    """front/trial_<n>.kvtune.yaml for each front trial; those of earlier fronts are removed."""
    written = []
    for record in results.records:
        if record.number in results.front and record.policy is not None:
            path = folder / FRONT / f"trial_{record.number}.kvtune.yaml"
            with replacing(path) as temporary:
                temporary.write_text(record.policy.to_yaml())
            written.append(path)
    for stale in set((folder / FRONT).glob("trial_*.kvtune.yaml")) - set(written):
        stale.unlink()
    return written


def write_recipe(folder: Path, results: StudyResults) -> list[Path]:
    path = folder / RECIPE
    with replacing(path) as temporary:
        temporary.write_text(results.recipe_yaml)
    return [path]


# Each writer on its own, so that one failing file costs only that file.
WRITERS: dict[str, Callable[[Path, StudyResults], list[Path]]] = {
    TRIALS_CSV: write_trials_table,
    PARETO_PNG: write_pareto_png,
    PARETO_HTML: write_pareto_html,
    FRONT: write_front_policies,
    RECIPE: write_recipe,
}


def write_result_files(folder: Path, results: StudyResults) -> list[Path]:
    """Every result file into `folder`, stopping at the first error."""
    return [path for write in WRITERS.values() for path in write(folder, results)]
