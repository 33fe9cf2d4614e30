"""What `kvtune tune` prints per trial when its output is not a terminal."""

import io
import re

import optuna
from rich.console import Console

from kvtune.autotune.cli.report import ProgressCallback, trial_reporter
from kvtune.autotune.study.optuna_study import run_trials
from tests.autotune.analytic_study import new_study, objective

MIB = 1 << 20


def test_piped_output_has_one_whole_line_per_trial(tmp_path):
    settings, study = new_study(tmp_path, name="a-study-with-a-rather-long-name")
    study.sampler = optuna.samplers.RandomSampler(seed=2)
    out = io.StringIO()
    console = Console(file=out, width=40)  # a file: not a terminal, and narrow
    with trial_reporter(console, study, 4) as report:
        assert not isinstance(report, ProgressCallback)
        run_trials(study, objective(n_trials=4), 4, [report])
    lines = out.getvalue().splitlines()
    trials = study.get_trials()
    assert len(lines) == len(trials) == 4
    for done, (line, trial) in enumerate(zip(lines, trials, strict=True), start=1):
        metrics = trial.user_attrs["metrics"]
        match = re.fullmatch(
            rf"{settings.name} \[{done}/4\] trial {trial.number}: retention ([0-9.]+), "
            r"([0-9.]+) MiB/seq",  # the analytic objective measures no latency
            line,
        )
        assert match, line
        assert float(match[1]) == round(metrics["accuracy_retention"], 3)
        assert float(match[2]) == round(metrics["kv_bytes_per_sequence"] / MIB, 2)
    assert "\x1b" not in out.getvalue()  # no escape codes in a log


def test_a_terminal_gets_the_live_bar(tmp_path):
    settings, study = new_study(tmp_path)
    console = Console(file=io.StringIO(), force_terminal=True)
    with trial_reporter(console, study, 2) as report:
        assert isinstance(report, ProgressCallback)


def test_the_policy_label_names_every_format_lever():
    from kvtune.autotune.cli.report import policy_label
    from kvtune.autotune.study.results import TrialRecord
    from kvtune.runtime.policy import KVPolicy

    policy = KVPolicy(
        "int4", "int4", group_size=64, k_scale_axis="channel", rotation="hadamard", block_size=32
    )
    record = TrialRecord(4, "COMPLETE", policy, {}, True, None, None)
    assert policy_label(record, 30) == "int4/int4 x30 g64/fp16 K-channel hadamard b32 c512"
