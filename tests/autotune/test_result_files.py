"""The result files a study leaves in studies/<name>/: this invocation's, none stale."""

import csv

import pytest

from kvtune.autotune.study.results import TrialRecord
from kvtune.autotune.tracking.result_files import (
    StudyResults,
    write_pareto_png,
    write_result_files,
)
from kvtune.runtime.policy import KVPolicy

OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence")
POLICIES = {
    0: KVPolicy(),
    1: KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=16),
    2: KVPolicy(k_dtype="fp8", v_dtype="fp4", group_size=16, scale_dtype="e4m3"),
}


def record(number: int, retention: float, kv_bytes: float, state="COMPLETE") -> TrialRecord:
    metrics = {"accuracy_retention": retention, "kv_bytes_per_sequence": kv_bytes}
    if state != "COMPLETE":
        metrics = {}
    return TrialRecord(number, state, POLICIES[number], metrics, True, None, None)


def results(records, front) -> StudyResults:
    return StudyResults(records, front, OBJECTIVES, 4, "model:\n  name: test\n")


def test_the_folder_holds_every_result_file_of_this_invocation(tmp_path):
    records = [record(0, 1.0, 4000.0), record(1, 0.97, 2000.0), record(2, 0.0, 0.0, "FAIL")]
    written = write_result_files(tmp_path, results(records, [0, 1]))
    names = {
        "trials.csv",
        "pareto_front.png",
        "pareto_front.html",
        "front/trial_0.kvtune.yaml",
        "front/trial_1.kvtune.yaml",
        "recipe.yaml",
    }
    assert {p.relative_to(tmp_path).as_posix() for p in written} == names
    assert {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")} == names
    with (tmp_path / "trials.csv").open() as rows:
        table = list(csv.DictReader(rows))
    assert [(r["trial"], r["state"], r["pareto"]) for r in table] == [
        ("0", "COMPLETE", "True"),
        ("1", "COMPLETE", "True"),
        ("2", "FAIL", "False"),
    ]
    for number in (0, 1):
        text = (tmp_path / "front" / f"trial_{number}.kvtune.yaml").read_text()
        assert KVPolicy.from_yaml(text) == POLICIES[number]
    assert (tmp_path / "pareto_front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "recipe.yaml").read_text() == "model:\n  name: test\n"


def test_a_later_invocation_leaves_nothing_of_an_earlier_front(tmp_path):
    first = [record(0, 1.0, 4000.0), record(1, 0.97, 2000.0)]
    write_result_files(tmp_path, results(first, [0, 1]))
    # Trial 2 dominates trial 1: the front is now 0 and 2.
    second = [*first, record(2, 0.98, 1000.0)]
    write_result_files(tmp_path, results(second, [0, 2]))
    assert sorted(p.name for p in (tmp_path / "front").iterdir()) == [
        "trial_0.kvtune.yaml",
        "trial_2.kvtune.yaml",
    ]
    with (tmp_path / "trials.csv").open() as rows:
        assert [r["trial"] for r in csv.DictReader(rows)] == ["0", "1", "2"]
    # No trial complete (every one failed): no plot is left from before.
    failed = [record(n, 0.0, 0.0, "FAIL") for n in range(3)]
    write_result_files(tmp_path, results(failed, []))
    assert not (tmp_path / "pareto_front.png").exists()
    assert not (tmp_path / "pareto_front.html").exists()
    assert not any((tmp_path / "front").iterdir())


def test_a_file_that_cannot_be_written_is_removed_not_left_stale(tmp_path):
    good = [record(0, 1.0, 4000.0)]
    write_pareto_png(tmp_path, results(good, [0]))
    assert (tmp_path / "pareto_front.png").is_file()
    # A complete trial without the objective it is drawn by: the plot fails.
    broken = [TrialRecord(0, "COMPLETE", POLICIES[0], {}, True, None, None)]
    with pytest.raises(KeyError):
        write_pareto_png(tmp_path, results(broken, [0]))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
