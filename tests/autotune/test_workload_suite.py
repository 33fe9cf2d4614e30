"""A study judges accuracy on the suite its workload names (workload.suite) unless the command
line names one (eval=), so bytes, latency and accuracy are measured at the traffic's lengths.

The expected suites are read here from the preset files themselves, not from kvtune."""

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from kvtune.autotune.cli.main import CONF_DIR
from kvtune.autotune.study.recipe import build_setup, recipe_from_config
from kvtune.runtime.errors import ConfigError

WORKLOADS = sorted(path.stem for path in (Path(CONF_DIR) / "workload").glob("*.yaml"))


def preset(group: str, name: str) -> dict:
    return yaml.safe_load((Path(CONF_DIR) / group / f"{name}.yaml").read_text())


def tune_recipe(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("tune", overrides)
    return recipe_from_config(cfg, overrides)


def serving_model(workload: str) -> list[str]:
    """A model preset whose context holds the workload (the default one where it does)."""
    longest = preset("workload", workload)["max_model_len"]
    if longest <= preset("model", "smollm2-135m")["max_position_embeddings"]:
        return []
    return ["model=qwen2.5-coder-0.5b"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_names_a_suite_and_the_study_uses_it(workload):
    overrides = [f"workload={workload}", *serving_model(workload)]
    named = preset("workload", workload)["suite"]
    recipe = tune_recipe(overrides)
    assert recipe["eval"] == preset("eval", named)
    suite = build_setup(recipe).suite  # validated against the study's model
    assert suite["name"] == named


def test_the_suite_follows_the_workload():
    recipe = tune_recipe(["workload=longdoc", "workload.suite=heldout"])
    assert recipe["eval"] == preset("eval", "heldout") != preset("eval", "quick")


def test_eval_on_the_command_line_wins():
    recipe = tune_recipe(["workload=longdoc", "eval=heldout"])
    assert recipe["eval"] == preset("eval", "heldout")
    assert preset("workload", "longdoc")["suite"] != "heldout"  # the override changed something


def test_a_workload_naming_no_preset_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as error:
        tune_recipe(["workload.suite=nosuch"])
    message = str(error.value)
    assert "\n" not in message
    assert "workload.suite" in message and "nosuch" in message
    assert "quick" in message and "heldout" in message  # the allowed presets are listed


def test_a_workload_longer_than_the_model_is_refused_in_one_line():
    longest = preset("model", "smollm2-135m")["max_position_embeddings"]
    workload = next(w for w in WORKLOADS if preset("workload", w)["max_model_len"] > longest)
    with pytest.raises(ConfigError) as error:
        build_setup(tune_recipe([f"workload={workload}"]))  # the default model: SmolLM2
    message = str(error.value)
    assert "\n" not in message and "workload.max_model_len" in message
