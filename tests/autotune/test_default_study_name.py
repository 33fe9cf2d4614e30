"""`kvtune tune`, `worker`, `export` and `dashboard` name the same study for the same model and
workload, `<model>-<workload>`, so `kvtune export` alone exports what `kvtune tune` alone ran."""

import pytest
from hydra import compose, initialize_config_dir

from kvtune.autotune.cli.main import CONF_DIR

COMMANDS = ("tune", "worker", "export", "dashboard")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "smollm2-135m-longdoc"),  # the README's main job
        (["workload=chat"], "smollm2-135m-chat"),
        (["model=llama-3.1-8b", "workload=chat"], "llama-3.1-8b-chat"),
        (["model=qwen2.5-7b"], "qwen2.5-7b-longdoc"),
    ],
)
def test_every_command_names_the_study_tune_names(overrides, expected):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        names = {command: compose(command, overrides).study.name for command in COMMANDS}
    assert names == dict.fromkeys(COMMANDS, expected)


def test_a_given_name_wins_everywhere():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for command in COMMANDS:
            assert compose(command, ["study.name=demo", "model=qwen2.5-7b"]).study.name == "demo"
