"""The Pareto PNG is readable: bytes in MiB without an offset, labels that do not overlap."""

import itertools

import matplotlib.pyplot as plt
import pytest

from kvtune.autotune.study.results import TrialRecord, pareto_front
from kvtune.autotune.tracking.plots import pareto_figure, pareto_png
from kvtune.runtime.policy import KVPolicy

OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence", "tpot_ms")
MIB = 2**20


def crowded_records() -> list[TrialRecord]:
    """40 trials of a study in a narrow band (1.0-1.4 MB, retention 0.985-1.0), with two pairs
    of trials at the very same point, as a study of a small model produces."""
    records = []
    for n in range(40):
        kv = 1_000_000 + (n * 7919) % 400_000
        # More bytes keep more accuracy, give or take a little: a front of many trials.
        retention = 0.985 + 0.015 * (kv - 1_000_000) / 400_000 - ((n * 104729) % 30) / 10_000
        metrics = {"accuracy_retention": retention, "kv_bytes_per_sequence": float(kv)}
        metrics["tpot_ms"] = 10.0 + (n * 31) % 17 / 10
        records.append(TrialRecord(n, "COMPLETE", KVPolicy(), metrics, n % 9 != 4, None, None))
    for copy_of, n in ((3, 40), (3, 41), (10, 42)):
        metrics = dict(records[copy_of].metrics)
        records.append(TrialRecord(n, "COMPLETE", KVPolicy(), metrics, True, None, None))
    return records


@pytest.fixture()
def figure():
    records = crowded_records()
    front = [r.number for r in pareto_front(records, OBJECTIVES)]
    figure = pareto_figure(records, front, OBJECTIVES)
    yield figure, records, front
    plt.close(figure)


def test_bytes_are_drawn_in_mib_with_plain_ticks(figure):
    fig, records, _ = figure
    fig.canvas.draw()
    axis = fig.axes[0]  # accuracy_retention against kv_bytes_per_sequence
    assert axis.get_ylabel() == "KV cache per sequence (MiB)"
    lows = min(r.metrics["kv_bytes_per_sequence"] for r in records) / MIB
    highs = max(r.metrics["kv_bytes_per_sequence"] for r in records) / MIB
    bottom, top = axis.get_ylim()
    assert bottom <= lows < highs <= top < 2  # MiB: about 0.95 to 1.33
    for panel in fig.axes[:3]:
        for side in (panel.xaxis, panel.yaxis):
            assert side.get_offset_text().get_text() == ""  # no "1e6" / "+0.99" offsets


def test_only_the_front_is_labelled_and_no_labels_overlap(figure):
    fig, records, front = figure
    renderer = fig.canvas.get_renderer()
    for axis in fig.axes[:3]:
        labels = list(axis.texts)
        numbers = [int(n) for t in labels for n in t.get_text().split(", ")]
        assert set(numbers) <= set(front) and len(numbers) == len(set(numbers))
        assert len(numbers) >= len(front) // 2  # most of the front is named
        boxes = [t.get_window_extent(renderer) for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b)
        markers = [
            axis.transData.transform(point)
            for collection in axis.collections
            for point in collection.get_offsets()
        ]
        assert not any(box.contains(x, y) for box in boxes for x, y in markers)
    # Trials 10 and 42 are one point of the front: one label names both, in every panel.
    assert {10, 42} <= set(front)
    for axis in fig.axes[:3]:
        assert "10, 42" in [t.get_text() for t in axis.texts]


def test_png_is_written(tmp_path):
    records = crowded_records()
    front = [r.number for r in pareto_front(records, OBJECTIVES)]
    pareto_png(records, front, OBJECTIVES, tmp_path / "front.png")
    assert (tmp_path / "front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
