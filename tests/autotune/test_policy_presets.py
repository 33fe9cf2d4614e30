"""The engine presets as a user selects them: `policy=<engine>/<kv-cache-dtype>` on the real CLI.

Every file conf/policy/<engine>/<dtype>.yaml is named after the engine's --kv-cache-dtype
(llama.cpp's --cache-type-k / -v), so its bytes per token are checked against the byte formula
of tests/kernels/formats/engine_formats_ref.py (written from the engines' sources) for that engine
and dtype."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from kvtune.autotune.config.settings import build_policy
from tests.kernels.formats.engine_formats_ref import kv_bytes_per_token_head, vllm_layer_kv_dtype

CONF = Path(__file__).resolve().parents[2] / "conf"
KVTUNE = [
    sys.executable,
    "-c",
    "import sys; from kvtune.autotune.cli.main import main; sys.exit(main())",
]
PRESETS = sorted(
    f"{path.parent.name}/{path.stem}"
    for engine in ("vllm", "sglang", "llamacpp")
    for path in (CONF / "policy" / engine).glob("*.yaml")
)


def test_every_engine_has_presets():
    expected = {"vllm/fp8", "vllm/nvfp4", "sglang/fp8_e4m3", "sglang/nvfp4", "llamacpp/q4_0"}
    assert expected <= set(PRESETS)


def json_objects(text: str) -> list[dict]:
    """The JSON objects printed one after another (one per multirun job)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        obj, at = decoder.raw_decode(text, at)
        objects.append(obj)
    return objects


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.1-8b"])
def test_plan_reports_the_engines_bytes_per_token(model, tmp_path):
    """One `kvtune plan -m` over every preset: head_dim 64 and 128 (the per-vector presets
    follow the model's head_dim), TurboQuant's first and last 2 layers at 16 bits."""
    result = subprocess.run(
        [*KVTUNE, "plan", "-m", f"policy={','.join(PRESETS)}", f"model={model}", "format=json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    plans = json_objects(result.stdout)
    assert len(plans) == len(PRESETS)
    arch = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())
    for preset, plan in zip(PRESETS, plans, strict=True):
        engine, dtype = preset.split("/")
        layers = arch["num_layers"]
        # vLLM keeps TurboQuant's boundary layers in the (16-bit) model dtype.
        layer_dtypes = [
            vllm_layer_kv_dtype(i, dtype, layers) if engine == "vllm" else dtype
            for i in range(layers)
        ]
        expected = arch["num_kv_heads"] * sum(
            kv_bytes_per_token_head(engine, d, arch["head_dim"]) for d in layer_dtypes
        )
        assert plan["kv_bytes_per_token"] == expected, preset
        assert plan["policy"]["tensor_scale"] == "unit"


@pytest.mark.parametrize("config", ["plan", "evaluate"])
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_compose_for_plan_and_evaluate(config, preset):
    """The preset fills the fields it names over conf/policy/default.yaml; a command-line
    override still wins."""
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(config, overrides=[f"policy={preset}", "policy.block_size=32"])
        default = compose(config)
    policy = build_policy(cfg.policy)
    assert policy.block_size == 32
    assert policy.tensor_scale == "unit"
    named = yaml.safe_load((CONF / "policy" / f"{preset}.yaml").read_text())
    assert (policy.k_dtype, policy.v_dtype) == (named["k_dtype"], named["v_dtype"])
    default_policy = build_policy(default.policy)
    if named["k_dtype"] == default_policy.k_dtype:  # llama.cpp's f16: its rotation is the change
        assert policy.rotation != default_policy.rotation
    else:
        assert policy.k_dtype != default_policy.k_dtype
