"""Pareto front pictures: a PNG (matplotlib, Agg: no display needed) and an interactive HTML
(plotly, self-contained so it opens offline) with each trial's policy on hover."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from autotune.study.results import TrialRecord, policy_columns  # noqa: E402

FRONT, FEASIBLE, INFEASIBLE = "Pareto front", "feasible", "infeasible"
COLORS = {FRONT: "#d62728", FEASIBLE: "#1f77b4", INFEASIBLE: "#9a9a9a"}


def _classes(records: Sequence[TrialRecord], front: Sequence[int]) -> dict[str, list[TrialRecord]]:
    done = [r for r in records if r.complete]
    return {
        FRONT: [r for r in done if r.number in front],
        FEASIBLE: [r for r in done if r.feasible and r.number not in front],
        INFEASIBLE: [r for r in done if not r.feasible],
    }


def pareto_png(
    records: Sequence[TrialRecord], front: Sequence[int], objectives: Sequence[str], path: Path
) -> None:
    """One panel per pair of objectives (a single objective is drawn against trial number)."""
    pairs = list(itertools.combinations(objectives, 2)) or [("trial", objectives[0])]
    figure, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.5), squeeze=False)
    for axis, (x_name, y_name) in zip(axes[0], pairs, strict=True):
        for label, group in _classes(records, front).items():
            if not group:
                continue
            xs = [r.number if x_name == "trial" else r.metrics[x_name] for r in group]
            ys = [r.metrics[y_name] for r in group]
            marker = "x" if label == INFEASIBLE else "o"
            axis.scatter(xs, ys, c=COLORS[label], marker=marker, label=label, s=36)
            for x, y, r in zip(xs, ys, group, strict=True):
                axis.annotate(
                    str(r.number), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
        axis.set_xlabel(x_name)
        axis.set_ylabel(y_name)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("kvtune study: trials and Pareto front (numbers are trial numbers)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _hover(record: TrialRecord, num_layers: int) -> str:
    lines = [f"trial {record.number}"]
    lines += [f"{k}: {v:.4g}" for k, v in record.metrics.items() if not k.startswith("task.")]
    lines += [f"{k}: {v}" for k, v in policy_columns(record.policy, num_layers).items()]
    return "<br>".join(lines)


def pareto_html(
    records: Sequence[TrialRecord],
    front: Sequence[int],
    objectives: Sequence[str],
    num_layers: int,
    path: Path,
) -> None:
    """2-D or 3-D scatter of the objectives (a single objective against trial number)."""
    axes = list(objectives) if len(objectives) > 1 else ["trial", objectives[0]]
    figure = go.Figure()
    for label, group in _classes(records, front).items():
        values = [[r.number if a == "trial" else r.metrics[a] for r in group] for a in axes]
        style = {
            "mode": "markers",
            "name": label,
            "marker": {"color": COLORS[label]},
            "text": [_hover(r, num_layers) for r in group],
            "hoverinfo": "text",
        }
        if len(axes) == 3:
            figure.add_trace(go.Scatter3d(x=values[0], y=values[1], z=values[2], **style))
        else:
            figure.add_trace(go.Scatter(x=values[0], y=values[1], **style))
    titles = {"xaxis_title": axes[0], "yaxis_title": axes[1]}
    if len(axes) == 3:
        figure.update_layout(scene={**titles, "zaxis_title": axes[2]})
    else:
        figure.update_layout(**titles)
    figure.update_layout(title="kvtune study: trials and Pareto front")
    figure.write_html(path, include_plotlyjs=True)
