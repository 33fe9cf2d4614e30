"""Every policy field is checked whatever the other fields say (issue 14): `kvtune plan`
refuses a group size that does not divide head_dim even when no stream is quantized."""

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
