"""The presets the export and benchmarks load equal what Hydra composes for `policy=<preset>`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvtune.autotune.config.engine_presets import POLICY_DIR, engine_presets
from kvtune.autotune.study.optuna_study import StudySettings
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESET_FILES = sorted(f"{path.parent.name}/{path.stem}" for path in POLICY_DIR.glob("*/*.yaml"))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_preset_loads_as_hydra_composes_it(head_dim):
    loaded = engine_presets(head_dim)
    assert sorted(loaded) == PRESET_FILES and len(PRESET_FILES) >= 8
    with initialize_config_dir(str(CONF), version_base=None):
        for name in PRESET_FILES:
            cfg = compose("plan", overrides=[f"policy={name}", f"model.head_dim={head_dim}"])
            assert loaded[name] == KVPolicy.from_dict(dict(cfg.policy)), name
    assert loaded["vllm/int8_per_token_head"].group_size == head_dim


def test_a_study_measures_llamacpps_presets_by_name():
    """study.engine_presets takes llamacpp/<type> for every preset file; f32 has none."""
    names = [f"llamacpp/{path.stem}" for path in sorted((POLICY_DIR / "llamacpp").glob("*.yaml"))]
    assert len(names) == 8
    assert StudySettings(name="s", engine_presets=names).engine_presets == tuple(names)
    with pytest.raises(ConfigError) as error:
        StudySettings(name="s", engine_presets=["llamacpp/f32"])
    assert error.value.field == "study.engine_presets"
