"""Picking a trial and mapping its policy onto vLLM and SGLang options."""

import pytest
import yaml

from autotune.config.settings import ServeSettings
from autotune.export.engines import (
    MAX_ENGINE_SEQS,
    layer_levels,
    sglang_args,
    sglang_mapping,
    vllm_config,
    vllm_mapping,
)
from autotune.study.results import TrialRecord, pareto_front, pick_trial
from runtime.arch import GIB, ModelArch
from runtime.errors import ConfigError
from runtime.kv_bytes import kv_bytes_per_sequence
from runtime.policy import KVPolicy

ARCH = ModelArch("test", 4, 4, 2, 64, 1 << 30, 8192)
SERVE = ServeSettings(max_model_len=4096, gpu_memory_utilization=0.85, expected_context_len=1024)
# Every key `vllm serve --config` accepts that an export may write (checked against vLLM's
# EngineArgs / CacheConfig: kv_cache_dtype, kv_cache_dtype_skip_layers, block_size, ...).
VLLM_KEYS = {
    "kv-cache-dtype",
    "kv-cache-dtype-skip-layers",
    "block-size",
    "enable-chunked-prefill",
    "max-num-batched-tokens",
    "max-num-seqs",
    "max-model-len",
    "gpu-memory-utilization",
}
SGLANG_OPTIONS = {
    "--kv-cache-dtype",
    "--page-size",
    "--chunked-prefill-size",
    "--max-running-requests",
    "--mem-fraction-static",
    "--context-length",
}


def mixed_policy() -> KVPolicy:
    return KVPolicy(
        layer_dtypes=("fp16/fp16", "fp8/fp4", "fp4/fp4", "fp8/fp8"),
        group_size=16,
        scale_dtype="e4m3",
        csa_ratio=4,
        csa_window=512,
        block_size=16,
        chunk_size=512,
    )


def test_vllm_keeps_exact_layers_and_quantizes_the_rest_to_fp8():
    mapping = vllm_mapping(mixed_policy(), 4)
    assert layer_levels(mixed_policy(), 4) == ["auto", "fp8", "fp4", "fp8"]
    assert mapping.kv_cache_dtype == "fp8_e4m3"
    assert mapping.skip_layers == (0,)
    assert mapping.equivalent.layer_pairs(4) == [("auto", "auto")] + [("fp8", "fp8")] * 3
    assert not mapping.equivalent.compressed


def test_vllm_config_uses_only_engine_keys():
    policy = mixed_policy()
    config = vllm_config(policy, vllm_mapping(policy, 4), SERVE, max_num_seqs=300)
    assert set(config) <= VLLM_KEYS
    assert config["kv-cache-dtype-skip-layers"] == ["0"]
    assert config["block-size"] == 16 and config["max-model-len"] == 4096
    assert config["max-num-batched-tokens"] == 512 and config["max-num-seqs"] == 300
    assert config["gpu-memory-utilization"] == 0.85
    assert yaml.safe_load(yaml.safe_dump(config)) == config


def test_uniform_exact_policy_exports_auto_without_skip_list():
    policy = KVPolicy()
    mapping = vllm_mapping(policy, 4)
    assert (mapping.kv_cache_dtype, mapping.skip_layers) == ("auto", ())
    assert "kv-cache-dtype-skip-layers" not in vllm_config(policy, mapping, SERVE, 8)


def test_sglang_takes_the_most_precise_level_any_layer_needs():
    assert sglang_mapping(mixed_policy(), ARCH).kv_cache_dtype == "auto"
    fp8 = KVPolicy(layer_dtypes=("fp8/fp4", "fp4/fp4", "fp4/fp4", "fp4/fp4"), group_size=16)
    assert sglang_mapping(fp8, ARCH).kv_cache_dtype == "fp8_e4m3"
    fp4 = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size=16)
    mapping = sglang_mapping(fp4, ARCH)
    assert mapping.kv_cache_dtype == "fp4_e2m1" and mapping.equivalent.group_size == 32
    args = sglang_args(fp4, mapping, SERVE, max_running=64)
    assert {line.split()[0] for line in args} == SGLANG_OPTIONS
    assert "--page-size 16" in args and "--context-length 4096" in args


def test_engine_configs_never_hold_less_precision_than_the_policy():
    policy = mixed_policy()
    ours = kv_bytes_per_sequence(ARCH, policy, 1024)
    for mapping in (vllm_mapping(policy, 4), sglang_mapping(policy, ARCH)):
        assert kv_bytes_per_sequence(ARCH, mapping.equivalent, 1024) >= ours
    assert MAX_ENGINE_SEQS >= 256


def record(number, retention, kv_bytes, tpot=10.0, feasible=True, state="COMPLETE"):
    metrics = {
        "accuracy_retention": retention,
        "kv_bytes_per_sequence": kv_bytes,
        "tpot_ms": tpot,
    }
    return TrialRecord(number, state, KVPolicy(), metrics, feasible, None, None)


RECORDS = [
    record(0, 1.00, 4000.0),
    record(1, 0.99, 2000.0),
    record(2, 0.95, 1000.0),
    record(3, 0.80, 500.0),
    record(4, 0.98, 3000.0),  # dominated by 1
    record(5, 0.70, 100.0, feasible=False),
    record(6, 0.0, 0.0, state="FAIL"),
]
OBJECTIVES = ("accuracy_retention", "kv_bytes_per_sequence")


def test_front_holds_feasible_non_dominated_trials():
    assert [r.number for r in pareto_front(RECORDS, OBJECTIVES)] == [0, 1, 2, 3]


def test_picks():
    assert pick_trial(RECORDS, OBJECTIVES, "max_accuracy").number == 0
    assert pick_trial(RECORDS, OBJECTIVES, "min_memory").number == 3
    assert pick_trial(RECORDS, OBJECTIVES, "min_memory", min_retention=0.9).number == 2
    assert pick_trial(RECORDS, OBJECTIVES, "max_accuracy", max_kv_gib=2500 / GIB).number == 1
    assert pick_trial(RECORDS, OBJECTIVES, "knee").number == 2
    assert pick_trial(RECORDS, OBJECTIVES, "trial=4").number == 4


@pytest.mark.parametrize(
    ("pick", "filters"),
    [("best", {}), ("trial=6", {}), ("trial=99", {}), ("knee", {"min_retention": 1.5})],
)
def test_bad_picks_fail_naming_pick(pick, filters):
    with pytest.raises(ConfigError) as error:
        pick_trial(RECORDS, OBJECTIVES, pick, **filters)
    assert error.value.field == "pick"
