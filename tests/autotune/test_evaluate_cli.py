"""`kvtune evaluate` takes the model as every command does: model=<preset> or model.path=."""

import json

from tests.autotune.conftest import run_kvtune


def test_eval_model_is_refused_in_one_line_naming_model_path(tmp_path, kvtune_cache):
    result = run_kvtune("evaluate", "eval.model=/models/x", cwd=tmp_path, cache=kvtune_cache)
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("kvtune evaluate: error: eval.model='/models/x' is invalid")
    assert "model.path=<folder>" in line and len(line.splitlines()) == 1


def test_policy_is_checked_against_the_folder_model_before_it_loads(
    tmp_path, kvtune_cache, tiny_model_folder
):
    # The tiny model's head_dim is 32; 48 is refused even with no quantized stream.
    result = run_kvtune(
        "evaluate",
        f"model.path={tiny_model_folder}",
        "policy.group_size=48",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("kvtune evaluate: error: policy.group_size=48")
    assert "head_dim=32" in result.stderr


def test_model_path_is_the_model_evaluated(tmp_path, kvtune_cache, tiny_model_folder, tiny_conf):
    result = run_kvtune(
        "evaluate",
        f"hydra.searchpath=[file://{tiny_conf}]",
        "eval=tiny",
        f"model.path={tiny_model_folder}",
        "policy.k_dtype=fp8",
        "policy.group_size=16",
        "format=json",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["model"] == str(tiny_model_folder)
    assert output["policy"]["k_dtype"] == "fp8" and output["accuracy_retention"] > 0


def test_a_budget_reading_the_whole_suite_context_is_refused_before_the_model_loads(
    tmp_path, kvtune_cache
):
    # The quick suite's context is 2048 tokens: 16 sinks + 512 window + 100 x 16 read it all.
    result = run_kvtune(
        "evaluate",
        "model=smollm2-135m",
        "policy.csa_ratio=4",
        "policy.csa_topk=100",
        "policy.csa_host=true",
        cwd=tmp_path,
        cache=kvtune_cache,
    )
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("kvtune evaluate: error: policy.csa_topk=100 is invalid: at most")
    assert len(line.splitlines()) == 1
