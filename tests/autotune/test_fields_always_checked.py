"""Every policy field is checked whatever the other fields say (issue 14): `kvtune plan`
refuses a group size that does not divide head_dim even when no stream is quantized; and the
model's dtype is taken as vLLM and PyTorch users spell it."""

import json

import pytest

from tests.autotune.conftest import run_kvtune


@pytest.mark.parametrize("dtypes", [(), ("policy.k_dtype=fp4", "policy.v_dtype=fp4")])
def test_plan_refuses_a_group_size_not_dividing_head_dim(tmp_path, kvtune_cache, dtypes):
    result = run_kvtune(
        "plan", "policy.group_size=48", *dtypes, cwd=tmp_path, cache=kvtune_cache, timeout=120
    )
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("kvtune plan: error: policy.group_size=48 is invalid")
    assert "head_dim=64" in line and len(line.splitlines()) == 1


def test_plan_takes_the_model_dtype_as_pytorch_spells_it(tmp_path, kvtune_cache):
    plans = {}
    for dtype in ("float32", "fp32"):
        auto = ("policy.k_dtype=auto", "policy.v_dtype=auto")
        result = run_kvtune(
            "plan", f"model.dtype={dtype}", *auto, "format=json", cwd=tmp_path, cache=kvtune_cache
        )
        assert result.returncode == 0, result.stderr
        plans[dtype] = json.loads(result.stdout)
    assert plans["float32"] == plans["fp32"]
    # auto streams are stored in the model's dtype: 4 bytes an element in fp32.
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K, V).
    assert plans["fp32"]["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4
