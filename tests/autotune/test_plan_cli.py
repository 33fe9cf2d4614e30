"""`kvtune plan` end to end, as a user runs it (subprocess, real Hydra composition)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.runtime.arch import GIB

KVTUNE = [
    sys.executable,
    "-c",
    "import sys; from kvtune.autotune.cli.main import main; sys.exit(main())",
]


def kvtune(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTUNE, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def plan_json(*overrides: str) -> dict:
    result = kvtune("plan", *overrides, "format=json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_design_example_reports_exact_bytes():
    plan = plan_json(
        "model=llama-3.1-8b",
        "model.num_layers=61",
        "model.head_dim=128",
        "model.num_kv_heads=8",
        "policy.k_dtype=fp16",
        "policy.v_dtype=fp16",
        "serve.max_model_len=131072",
    )
    assert plan["kv_bytes_per_token"] == 249856
    assert plan["kv_bytes_per_sequence"] == 32749125632


def test_budget_and_capacity_follow_the_formula():
    plan = plan_json(
        "model=qwen2.5-7b",
        "device=l4-24gb",
        "serve.max_model_len=32768",
        "serve.gpu_memory_utilization=0.9",
        "serve.activation_reserve_gib=1.5",
    )
    budget = int(22.5 * GIB * 0.9 - int(14.19 * GIB) - 1.5 * GIB)
    per_sequence = 28 * 4 * 128 * 2 * 2 * 32768
    assert plan["kv_budget_bytes"] == budget
    assert plan["kv_bytes_per_sequence"] == per_sequence
    # kvtune's engine sets aside a 16-token block a sequence and a 512-token step's 32 once.
    block = 28 * 4 * 128 * 2 * 2 * 16
    assert (plan["reserve_bytes_per_sequence"], plan["reserve_bytes_shared"]) == (block, 32 * block)
    fits = (budget - 32 * block) // (per_sequence + block)
    assert plan["max_num_seqs"] == fits
    assert plan["headroom_bytes"] == budget - fits * (per_sequence + block) - 32 * block


def test_compare_lists_the_standard_alternatives_in_order_of_memory():
    plan = plan_json("model=llama-3.1-8b", "serve.max_model_len=65536")
    rows = {row["name"]: row for row in plan["compare"]}
    assert list(rows) == ["fp16", "fp8", "fp4 g16", "fp8 + csa2", "fp8 + csa4", "fp4 g16 + csa4"]
    assert rows["fp8"]["kv_bytes_per_sequence"] * 2 == rows["fp16"]["kv_bytes_per_sequence"]
    # fp4 g16 with e4m3 scales: 64 code bytes + 8 scale bytes per 128-element vector.
    assert rows["fp4 g16"]["kv_bytes_per_token"] == 32 * 8 * 2 * (64 + 8)
    sizes = [rows[n]["kv_bytes_per_sequence"] for n in ("fp8", "fp8 + csa2", "fp8 + csa4")]
    assert sizes == sorted(sizes, reverse=True)
    assert rows["fp4 g16 + csa4"]["max_num_seqs"] > rows["fp16"]["max_num_seqs"]


def test_a_selection_policy_is_compared_with_plain_alternatives():
    """Selection, streamed staging and per-channel keys are the user's, not the alternatives':
    each alternative is its plain format (fp16's bytes by the formula), none of them dropped."""
    plan = plan_json(
        "model=llama-3.1-8b",
        "serve.max_model_len=8192",
        "policy.k_dtype=int4",
        "policy.v_dtype=int4",
        "policy.group_size=64",
        "policy.k_scale_axis=channel",
        "policy.csa_ratio=2",
        "policy.csa_window=256",
        "policy.csa_topk=80",
        "policy.csa_host=true",
        "policy.csa_summary=none",
        "policy.csa_index_dtype=int4",
        "policy.csa_staging=streamed",
    )
    rows = {row["name"]: row for row in plan["compare"]}
    assert list(rows) == ["fp16", "fp8", "fp4 g16", "fp8 + csa2", "fp8 + csa4", "fp4 g16 + csa4"]
    assert rows["fp16"]["kv_bytes_per_sequence"] == 32 * 8 * 128 * 2 * 2 * 8192
    for row in rows.values():
        policy = row["policy"]
        assert (policy["csa_topk"], policy["csa_host"], policy["k_scale_axis"]) == (
            0,
            False,
            "token",
        )
    assert plan["kv_bytes_per_sequence"] < rows["fp4 g16 + csa4"]["kv_bytes_per_sequence"]


def test_per_layer_budgets_fetch_their_own_blocks_beside_the_largest_staging_pool():
    """layer_csa_topk from the command line: 80 blocks in 8 of Llama-3.1-8B's 32 layers and 20
    in the rest fetch (8 x 80 + 24 x 20) / (32 x 80) of the uniform budget's bytes (every
    layer has one format), on the same device bytes (the staging pool follows the largest)."""
    selection = (
        "model=llama-3.1-8b",
        "serve.max_model_len=8192",
        "policy.k_dtype=fp8",
        "policy.v_dtype=fp8",
        "policy.csa_ratio=2",
        "policy.csa_window=256",
        "policy.csa_host=true",
        "policy.csa_summary=none",
    )
    budgets = [20] * 12 + [80] * 8 + [20] * 12
    pyramid = plan_json(*selection, f"policy.layer_csa_topk=[{','.join(map(str, budgets))}]")
    uniform = plan_json(*selection, "policy.csa_topk=80")
    assert pyramid["policy"]["csa_topk"] == 80 and pyramid["policy"]["layer_csa_topk"] == budgets
    assert pyramid["kv_bytes_per_sequence"] == uniform["kv_bytes_per_sequence"]
    fetched = (pyramid["max_fetch_bytes_per_step"], uniform["max_fetch_bytes_per_step"])
    assert fetched[0] * 32 * 80 == fetched[1] * (8 * 80 + 24 * 20)
    short = kvtune("plan", *selection, "policy.layer_csa_topk=[80,20]")
    assert short.returncode == 2 and short.stdout == ""
    assert short.stderr.strip().endswith("exactly one budget per layer: the model has 32 layers")


def test_integer_formats_and_rotation_are_planned_with_exact_bytes():
    overrides = (
        "model=llama-3.1-8b",
        "serve.max_model_len=8192",
        "policy.k_dtype=int4",
        "policy.v_dtype=int4",
        "policy.group_size=32",
    )
    plan = plan_json(*overrides)
    rotated = plan_json(*overrides, "policy.rotation=hadamard")
    # 32 layers, 8 KV heads, head_dim 128: 64 code bytes, then 4 groups of an fp16 scale and
    # an fp16 zero point, for K and for V. The rotation stores nothing.
    per_token = 32 * 8 * 2 * (64 + 4 * (2 + 2))
    assert plan["kv_bytes_per_token"] == rotated["kv_bytes_per_token"] == per_token
    assert plan["kv_bytes_per_sequence"] == rotated["kv_bytes_per_sequence"] == per_token * 8192
    assert (plan["policy"]["rotation"], rotated["policy"]["rotation"]) == ("none", "hadamard")
    assert rotated["compare"][0]["policy"]["rotation"] == "hadamard"


def test_mla_preset():
    plan = plan_json("model=deepseek-v3", "device=h200-141gb", "serve.max_model_len=4096")
    assert plan["kv_bytes_per_token"] == 61 * 576 * 2
    assert plan["max_num_seqs"] == 0  # 642 GiB of weights do not fit one H200
    assert any("No room for a KV cache" in w for w in plan["warnings"])


def test_warnings_follow_the_design_advice():
    plan = plan_json(
        "policy.csa_ratio=4",
        "serve.max_model_len=8192",
        "serve.expected_context_len=1000",
        "serve.gpu_memory_utilization=0.98",
        "policy.k_dtype=fp4",
        "policy.group_size=tensor",
    )
    text = " ".join(plan["warnings"])
    for phrase in ("below ~32K", "far above the workload", "0.90", "coarse scales"):
        assert phrase in text
    assert plan["max_num_seqs_at_expected_context"] > plan["max_num_seqs"]


def test_budget_below_one_sequence_is_flagged():
    plan = plan_json("model=llama-3.1-8b", "device=l4-24gb", "serve.max_model_len=131072")
    assert plan["max_num_seqs"] == 0
    assert any("below one 131072-token sequence" in w for w in plan["warnings"])


def test_model_path_reads_config_json_and_command_line_wins(tmp_path):
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = plan_json(f"model.path={tmp_path}")
    assert plan["model"] == tmp_path.name
    assert plan["kv_bytes_per_token"] == 24 * 2 * 64 * 2 * 2
    assert plan["weights_bytes"] > 0
    overridden = plan_json(f"model.path={tmp_path}", "model.num_layers=12")
    assert overridden["kv_bytes_per_token"] == 12 * 2 * 64 * 2 * 2


def test_table_output_is_readable():
    result = kvtune("plan", "model=llama-3.1-8b", "serve.max_model_len=32768")
    assert result.returncode == 0, result.stderr
    assert "max_num_seqs" in result.stdout and "fp4 g16 + csa4" in result.stdout


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("policy.k_dtype=int5", "policy.k_dtype"),
        ("policy.chunk_size=100", "policy.chunk_size"),
        ("policy.k_dtype=fp8 policy.group_size=48", "policy.group_size"),
        ("policy.csa_ratio=3", "policy.csa_ratio"),
        ("policy.scale_dtype=fp64", "policy.scale_dtype"),
        ("policy.layer_dtypes=[fp8/fp4]", "policy.layer_dtypes"),
        ("serve.gpu_memory_utilization=1.5", "serve.gpu_memory_utilization"),
        ("model.num_kv_heads=4", "model.num_kv_heads"),
        ("model.path=/nonexistent", "model.path"),
        # A selection budget that reads the whole context (16 + 512 + 100 x 16 >= 2048).
        (
            "serve.max_model_len=2048 policy.csa_ratio=4 policy.csa_topk=100 policy.csa_host=true",
            "policy.csa_topk",
        ),
        ("format=xml", "format"),
    ],
)
def test_invalid_settings_give_one_line_naming_the_field(override, field, tmp_path):
    result = kvtune("plan", *override.split(), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{field}=" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no Hydra output folders left behind


def test_unknown_command_and_help():
    assert kvtune("bogus").returncode == 2
    result = kvtune("--help")
    assert result.returncode == 0 and "plan" in result.stdout
