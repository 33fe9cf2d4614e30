"""Models named on the command line: the embedded Qwen2.5-Coder preset plans, an unknown preset
is one line naming the group, and a study whose sequences outgrow the model's positions is
refused in one line before anything is written (subprocesses, real Hydra composition)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.autotune.cli.main import CONF_DIR
from kvtune.autotune.cli.presets import check_presets
from kvtune.runtime.errors import ConfigError
from tests.autotune.conftest import run_kvtune


def one_error_line(result, command: str) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtune {command}: error: "), lines
    return lines[0]


def test_qwen_coder_preset_plans_with_its_32k_context(tmp_path, kvtune_cache):
    result = run_kvtune(
        "plan",
        "model=qwen2.5-coder-0.5b",
        "serve.max_model_len=32768",
        "format=json",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"] == "qwen2.5-coder-0.5b"
    # 24 layers x 2 KV heads x 64 dims x (K and V) x 2 bytes: fp16's bytes a token
    fp16 = next(row for row in plan["compare"] if row["name"] == "fp16")
    assert fp16["kv_bytes_per_token"] == 24 * 2 * 64 * 2 * 2


@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_an_unknown_model_preset_is_one_line_listing_the_presets(tmp_path, kvtune_cache, command):
    result = run_kvtune(command, "model=qwen-nonexistent", cwd=tmp_path, cache=kvtune_cache)
    line = one_error_line(result, command)
    assert "model='qwen-nonexistent'" in line and "qwen2.5-coder-0.5b" in line
    assert list(tmp_path.iterdir()) == []


def test_a_study_longer_than_the_models_positions_is_refused(tmp_path, kvtune_cache):
    result = run_kvtune(
        "tune", "workload.max_model_len=8193", cwd=tmp_path, cache=kvtune_cache, timeout=120
    )
    line = one_error_line(result, "tune")
    assert "workload.max_model_len=8193" in line and "(8192 tokens)" in line
    assert list(tmp_path.iterdir()) == []


def test_presets_of_the_search_path_are_known(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("name: tiny\n")
    check_presets(CONF_DIR, ["model=tiny", f"hydra.searchpath=[file://{tmp_path}]"])
    check_presets(CONF_DIR, ["policy=vllm/fp8", "-m", "workload=chat,longdoc", "model.path=/x"])
    with pytest.raises(ConfigError) as error:
        check_presets(CONF_DIR, ["model=tiny"])
    assert error.value.field == "model" and "smollm2-135m" in error.value.allowed
    with pytest.raises(ConfigError, match="workload='nope'"):
        check_presets(CONF_DIR, ["-m", "workload=chat,nope"])


def test_conf_model_lists_every_embedded_model():
    """`model=<name>` reaches the runtime by the preset's name: each embedded model has one."""
    from kvtune.runtime.embedded_models import EMBEDDED_MODELS

    presets = {path.stem for path in Path(CONF_DIR, "model").glob("*.yaml")}
    assert set(EMBEDDED_MODELS) <= presets
