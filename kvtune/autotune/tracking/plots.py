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
from matplotlib.figure import Figure  # noqa: E402

from kvtune.autotune.study.results import TrialRecord, policy_columns  # noqa: E402

FRONT, FEASIBLE, INFEASIBLE = "Pareto front", "feasible", "infeasible"
COLORS = {FRONT: "#d62728", FEASIBLE: "#1f77b4", INFEASIBLE: "#9a9a9a"}


def _classes(records: Sequence[TrialRecord], front: Sequence[int]) -> dict[str, list[TrialRecord]]:
    done = [r for r in records if r.complete]
    return {
        FRONT: [r for r in done if r.number in front],
        FEASIBLE: [r for r in done if r.feasible and r.number not in front],
        INFEASIBLE: [r for r in done if not r.feasible],
    }


# Metrics drawn in other units than they are stored in: (axis label, factor).
MIB = 1 << 20
DISPLAY = {
    "kv_bytes_per_sequence": ("KV cache per sequence (MiB)", 1 / MIB),
    "kv_bytes_per_token": ("KV cache per token (MiB)", 1 / MIB),
}
# Where a trial's label may go, in points from its marker, tried in order.
LABEL_OFFSETS = ((4, 4), (4, -10), (-12, 4), (-12, -10), (4, 12), (4, -18), (-20, 12), (-20, -18))
# Front points closer than this (pixels) share one label ("3, 7").
SAME_SPOT_PX = 4.0


def axis_values(name: str, records: Sequence[TrialRecord]) -> tuple[str, list[float]]:
    """Axis label and values of a metric (bytes in MiB), or of the trial number."""
    if name == "trial":
        return "trial", [float(r.number) for r in records]
    label, factor = DISPLAY.get(name, (name, 1.0))
    return label, [r.metrics[name] * factor for r in records]


def _label_front(
    axis: plt.Axes, points: list[tuple[float, float, int]], drawn: list[tuple[float, float]]
) -> None:
    """Trial numbers next to the front's points, without overlaps: points at one spot share a
    label; each label takes the first offset whose box meets no earlier label nor any drawn
    marker (a point with no free offset stays unlabelled)."""
    renderer = axis.figure.canvas.get_renderer()
    spots: list[tuple[float, float, float, float, list[int]]] = []  # x, y, pixel x, pixel y
    for x, y, number in sorted(points):
        px, py = axis.transData.transform((x, y))
        near = [s for s in spots if abs(s[2] - px) < SAME_SPOT_PX and abs(s[3] - py) < SAME_SPOT_PX]
        if near:
            near[0][4].append(number)
        else:
            spots.append((x, y, px, py, [number]))
    markers = [axis.transData.transform(point) for point in drawn]
    placed = []
    for x, y, _, _, numbers in spots:
        for offset in LABEL_OFFSETS:
            note = axis.annotate(
                ", ".join(map(str, sorted(numbers))),
                (x, y),
                xytext=offset,
                textcoords="offset points",
                fontsize=7,
            )
            box = note.get_window_extent(renderer)
            covers_marker = any(box.contains(mx, my) for mx, my in markers)
            if not covers_marker and not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            note.remove()


def pareto_png(
    records: Sequence[TrialRecord], front: Sequence[int], objectives: Sequence[str], path: Path
) -> None:
    """The Pareto figure (pareto_figure) as a PNG."""
    figure = pareto_figure(records, front, objectives)
    figure.savefig(path)
    plt.close(figure)


def pareto_figure(
    records: Sequence[TrialRecord], front: Sequence[int], objectives: Sequence[str]
) -> Figure:
    """One panel per pair of objectives (a single objective is drawn against trial number);
    bytes in MiB, plain tick labels (no offset), the front's points labelled by trial."""
    pairs = list(itertools.combinations(objectives, 2)) or [("trial", objectives[0])]
    figure, axes = plt.subplots(
        1, len(pairs), figsize=(5.5 * len(pairs), 4.5), squeeze=False, dpi=120
    )
    classes = _classes(records, front)
    for axis, (x_name, y_name) in zip(axes[0], pairs, strict=True):
        for label, group in classes.items():
            if not group:
                continue
            x_label, xs = axis_values(x_name, group)
            y_label, ys = axis_values(y_name, group)
            marker = "x" if label == INFEASIBLE else "o"
            axis.scatter(xs, ys, c=COLORS[label], marker=marker, label=label, s=36)
            axis.set_xlabel(x_label)
            axis.set_ylabel(y_label)
        axis.ticklabel_format(useOffset=False, style="plain")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("kvtune study: trials and Pareto front (labels: trial numbers on the front)")
    figure.tight_layout()
    done = [r for group in classes.values() for r in group]
    for axis, (x_name, y_name) in zip(axes[0], pairs, strict=True):
        on_front = classes[FRONT]
        _, xs = axis_values(x_name, on_front)
        _, ys = axis_values(y_name, on_front)
        drawn = list(zip(axis_values(x_name, done)[1], axis_values(y_name, done)[1], strict=True))
        front_points = [(x, y, r.number) for x, y, r in zip(xs, ys, on_front, strict=True)]
        _label_front(axis, front_points, drawn)
    return figure


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
        values = [axis_values(a, group)[1] for a in axes]
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
    names = [axis_values(a, [])[0] for a in axes]
    titles = {"xaxis_title": names[0], "yaxis_title": names[1]}
    if len(axes) == 3:
        figure.update_layout(scene={**titles, "zaxis_title": names[2]})
    else:
        figure.update_layout(**titles)
    figure.update_layout(title="kvtune study: trials and Pareto front")
    figure.write_html(path, include_plotlyjs=True)
