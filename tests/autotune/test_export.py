"""Picking a trial and mapping its policy onto vLLM, SGLang and llama-server options."""

import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from kvtune.autotune.config.settings import (
    DeviceSpec,
    ServeSettings,
    build_device,
    build_model_arch,
)
from kvtune.autotune.config.workload import Workload
from kvtune.autotune.export.engines import (
    _policy_gaps,
    compact_policy,
    engine_max_num_seqs,
    index_ranges,
    layer_levels,
    layer_ranges,
    llamacpp_mapping,
    sglang_args,
    sglang_mapping,
    vllm_config,
    vllm_mapping,
    write_export,
)
from kvtune.autotune.export.llamacpp import llama_server_args, llamacpp_gaps, stream_types
from kvtune.autotune.search.sensitivity import RuntimeSettings
from kvtune.autotune.search.space import SearchConfig
from kvtune.autotune.study.objectives import Constraints
from kvtune.autotune.study.recipe import TuneSetup
from kvtune.autotune.study.results import TrialRecord, pareto_front, pick_trial
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy

CONF = Path(__file__).resolve().parents[2] / "conf"
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
VLLM_OFFLOAD_KEYS = {"kv-offloading-size", "kv-offloading-backend"}  # CacheConfig, for a host tier
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
    mapping = vllm_mapping(mixed_policy(), ARCH)
    assert layer_levels(mixed_policy(), 4) == ["auto", "fp8", "fp4", "fp8"]
    assert mapping.kv_cache_dtype == "fp8_e4m3"
    assert mapping.skip_layers == (0,)
    assert mapping.equivalent.layer_pairs(4) == [("auto", "auto")] + [("fp8", "fp8")] * 3
    assert not mapping.equivalent.compressed


def test_vllm_config_uses_only_engine_keys():
    policy = mixed_policy()
    config = vllm_config(policy, vllm_mapping(policy, ARCH), SERVE, max_num_seqs=300)
    assert set(config) <= VLLM_KEYS
    assert config["kv-cache-dtype-skip-layers"] == ["0"]
    assert config["block-size"] == 16 and config["max-model-len"] == 4096
    assert config["max-num-batched-tokens"] == 512 and config["max-num-seqs"] == 300
    assert config["gpu-memory-utilization"] == 0.85
    assert yaml.safe_load(yaml.safe_dump(config)) == config


def test_uniform_exact_policy_exports_auto_without_skip_list():
    policy = KVPolicy()
    mapping = vllm_mapping(policy, ARCH)
    assert (mapping.kv_cache_dtype, mapping.skip_layers) == ("auto", ())
    assert "kv-cache-dtype-skip-layers" not in vllm_config(policy, mapping, SERVE, 8)


def test_sglang_takes_the_most_precise_level_any_layer_needs():
    assert sglang_mapping(mixed_policy(), ARCH).kv_cache_dtype == "auto"
    fp8 = KVPolicy(layer_dtypes=("fp8/fp4", "fp4/fp4", "fp4/fp4", "fp4/fp4"), group_size=16)
    assert sglang_mapping(fp8, ARCH).kv_cache_dtype == "fp8_e4m3"
    fp4 = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size=16)
    mapping = sglang_mapping(fp4, ARCH)  # fp16 group scales: no SGLang format stores these
    assert mapping.kv_cache_dtype == "nvfp4" and mapping.preset is None
    assert (mapping.equivalent.group_size, mapping.equivalent.scale_dtype) == (16, "e4m3")
    args = sglang_args(fp4, mapping, SERVE, max_running=64)
    assert {line.split()[0] for line in args} == SGLANG_OPTIONS
    assert "--page-size 16" in args and "--context-length 4096" in args


def test_integer_layers_export_as_fp8_and_are_named_as_gaps():
    policy = KVPolicy(
        layer_dtypes=("int8/int8", "int4/fp4", "int2/int2", "fp16/int4"),
        group_size=16,
        rotation="hadamard",
    )
    assert layer_levels(policy, 4) == ["fp8", "fp8", "fp8", "auto"]
    int4 = KVPolicy(k_dtype="int4", v_dtype="int4", group_size=16)
    assert sglang_mapping(int4, ARCH).kv_cache_dtype == "fp8_e4m3"
    assert vllm_mapping(int4, ARCH).kv_cache_dtype == "fp8_e4m3"
    gaps = _policy_gaps(policy, ARCH, formats_exported=False)
    assert any("int2, int4, int8" in gap and "group of 16" in gap for gap in gaps)
    assert any("hadamard rotation" in gap for gap in gaps)


def test_engines_keep_every_token_of_a_compressed_policy():
    policy = mixed_policy()
    ours = kv_bytes_per_sequence(ARCH, policy, 1024)
    for mapping in (vllm_mapping(policy, ARCH), sglang_mapping(policy, ARCH)):
        assert kv_bytes_per_sequence(ARCH, mapping.equivalent, 1024) >= ours


@pytest.mark.parametrize(
    "changes",
    [
        {"csa_topk": 8, "csa_host": True},
        {"csa_topk": 8, "csa_host": True, "csa_summary": "none", "csa_index_dtype": "int4"},
        {"csa_topk": 8, "csa_host": True, "csa_staging": "streamed"},
        {"csa_topk": 8, "csa_host": True, "csa_select_every": 4},
        {"csa_topk": 8, "csa_host": True, "layer_csa_select_every": (1, 4, 4, 1)},
        {"csa_topk": 8, "layer_csa_topk": (2, 8, 8, 0), "csa_host": True},
        {"csa_keep": 0.25, "csa_window": 256},
    ],
)
def test_selected_and_kept_blocks_export_as_every_token_kept_and_are_named_as_gaps(changes):
    policy = KVPolicy("fp8", "fp8", group_size="tensor", csa_ratio=8, **changes)
    ours = kv_bytes_per_sequence(ARCH, policy, 4096)
    for mapping in (vllm_mapping(policy, ARCH), sglang_mapping(policy, ARCH)):
        equivalent = mapping.equivalent
        assert not equivalent.compressed and not equivalent.selects and not equivalent.keeps
        assert kv_bytes_per_sequence(ARCH, equivalent, 4096) > ours
    gaps = " ".join(_policy_gaps(policy, ARCH, formats_exported=True))
    assert ("host-memory tier" in gaps) == ("csa_topk" in changes)
    assert ("key bounds in a int4 index" in gaps) == ("csa_index_dtype" in changes)
    assert ("kept exact by the attention they received" in gaps) == ("csa_keep" in changes)
    assert ("one staging pool the layers share" in gaps) == ("csa_staging" in changes)
    reuses = "csa_select_every" in changes or "layer_csa_select_every" in changes
    assert ("each choice reused for 4 positions" in gaps) == reuses
    assert ("(by layer: 1, 4, 4, 1)" in gaps) == ("layer_csa_select_every" in changes)
    assert ("0-8 older blocks (by layer: 2, 8, 8, 0)" in gaps) == ("layer_csa_topk" in changes)


def test_max_num_seqs_is_what_the_target_device_fits():
    mapping = vllm_mapping(mixed_policy(), ARCH)  # layer 0 bf16, layers 1-3 fp8 per tensor
    # A token: 2 KV heads x 64 x (K, V) x (2 B in layer 0 + 1 B in each of 3 fp8 layers).
    per_sequence = 2 * 64 * 2 * (2 + 3 * 1) * SERVE.expected_context_len
    for memory_gib in (24, 80, 141):
        device = DeviceSpec(f"{memory_gib}g", memory_gib, 1000)
        # memory x 0.85 - 1 GiB of weights - 1 GiB activation reserve
        budget = int(memory_gib * GIB * 0.85) - 2 * GIB
        assert engine_max_num_seqs(ARCH, mapping, device, SERVE) == budget // per_sequence
    assert engine_max_num_seqs(ARCH, mapping, DeviceSpec("tiny", 1, 1000), SERVE) == 1


def test_layer_ranges_keep_notes_short():
    pairs = ["fp8/fp8"] * 10 + ["auto/auto"] + ["fp8/fp8"] * 19
    assert layer_ranges(pairs) == [
        "layers 0-9: fp8/fp8",
        "layer 10: auto/auto",
        "layers 11-29: fp8/fp8",
    ]
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    uniform = compact_policy(KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=16), 30)
    assert uniform.startswith("layers 0-29: fp8/fp8 (") and uniform.count("fp8/fp8") == 1


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


def preset(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def smollm_chat_setup() -> TuneSetup:
    """What an export of a SmolLM2 chat study reads, from the project's presets."""
    arch = build_model_arch(preset("model", "smollm2-135m"))
    workload = Workload.from_dict(preset("workload", "chat"))
    limits = {"max_model_len": workload.max_model_len, "expected_context_len": workload.context_len}
    serve = ServeSettings(**{**preset("serve", "default"), **limits})
    return TuneSetup(
        recipe={},
        model="smollm2-135m",
        folder=Path("unused"),
        arch=arch,
        device=build_device(preset("device", "cpu")),
        serve=serve,
        workload=workload,
        search=SearchConfig.from_dict(preset("search", "default"), arch),
        objectives=OBJECTIVES,
        constraints=Constraints(),
        suite={"name": "quick"},
        runtime=RuntimeSettings(),
    )


def test_exports_are_sized_for_the_target_device_and_notes_are_compact(tmp_path):
    setup = smollm_chat_setup()
    pairs = ("fp8/fp8",) * 10 + ("fp16/fp16",) + ("fp8/fp8",) * 19
    policy = KVPolicy(layer_dtypes=pairs, group_size="tensor")
    trial = TrialRecord(3, "COMPLETE", policy, {"accuracy_retention": 0.99}, True, None, None)
    seqs = {}
    for name in ("l4-24gb", "h200-141gb"):
        device = build_device(preset("device", name))
        write_export(tmp_path / name, trial, setup, device, "s", "knee")
        vllm = yaml.safe_load((tmp_path / name / "vllm.yaml").read_text())
        mapping = vllm_mapping(policy, setup.arch)
        # SmolLM2: 3 KV heads x 64 dims x (K, V); layer 10 in bf16 (2 B), 29 layers fp8 (1 B).
        per_sequence = 3 * 64 * 2 * (2 + 29) * setup.workload.context_len
        budget = int(device.memory_gib * GIB * 0.9 - setup.arch.weights_bytes - GIB)
        assert vllm["max-num-seqs"] == budget // per_sequence
        assert vllm["max-num-seqs"] == engine_max_num_seqs(setup.arch, mapping, device, setup.serve)
        seqs[name] = vllm["max-num-seqs"]
        notes = (tmp_path / name / "NOTES.md").read_text()
        # Per-tensor fp8 is vLLM's own fp8: exported exactly, layer 10 kept in the model dtype.
        assert vllm["kv-cache-dtype"] == "fp8" and vllm["kv-cache-dtype-skip-layers"] == ["10"]
        assert "kv-cache-dtype-skip-layers 10: the same format as this policy" in notes
        assert "kvtune form: layers 0-29: auto/auto" in notes  # SGLang cannot skip layers
        assert max(line.count("fp8/fp8") for line in notes.splitlines()) <= 2
    assert seqs["h200-141gb"] > 5 * seqs["l4-24gb"] > 1024


# The --kv-cache-dtype values the engines accept (vLLM 0.33.0 CacheConfig, SGLang 0.5.23
# server arguments; docs/engine_formats.md).
VLLM_KV_DTYPES = {
    "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head",
    "int8_per_token_head", "int4_per_token_head", "nvfp4", "nvfp4_4over6", "turboquant_k8v4",
    "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
}  # fmt: skip
SGLANG_KV_DTYPES = {
    "auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16",
}  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "vllm", "sglang"),
    [
        # NVFP4: E2M1, E4M3 scales per 16 (the global scale is not storage: calibrated is fine).
        (KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"), "nvfp4", "nvfp4"),
        (KVPolicy("fp4_4over6", "fp4_4over6", group_size=16, scale_dtype="e4m3"),
         "nvfp4_4over6", None),
        (KVPolicy("fp4_ties_away", "fp4_ties_away", group_size=16, scale_dtype="ue8m0"),
         None, "fp4_mx_block16"),
        # One fp32 scale per vector of head_dim 64.
        (KVPolicy("int8_symmetric", "int8_symmetric", group_size=64, scale_dtype="fp32"),
         "int8_per_token_head", None),
        (KVPolicy("fp8", "fp8", group_size=64, scale_dtype="fp32"), "fp8_per_token_head", None),
        (KVPolicy("fp8", "fp8", group_size="tensor"), "fp8", "fp8_e4m3"),
        # vLLM's rotated int4: its transform and the zero point inside the fp32 scale word.
        (KVPolicy("int4_zp_in_scale", "int4_zp_in_scale", group_size=64, scale_dtype="fp32",
                  rotation="vllm_rht"), "int4_per_token_head", None),
        (KVPolicy("int4_zp_in_scale", "int4_zp_in_scale", group_size=64, scale_dtype="fp32",
                  rotation="hadamard"), None, None),
        # Near misses: another group size, a rotation, a recent fp16 window.
        (KVPolicy("fp4", "fp4", group_size=32, scale_dtype="e4m3"), None, None),
        (KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3", rotation="hadamard"),
         None, None),
        (KVPolicy("fp8", "fp8", group_size="tensor", recent_unquantized=64), None, None),
    ],
)  # fmt: skip
def test_a_policy_storing_an_engine_format_exports_that_format_exactly(policy, vllm, sglang):
    for mapping, expected, accepted in (
        (vllm_mapping(policy, ARCH), vllm, VLLM_KV_DTYPES),
        (sglang_mapping(policy, ARCH), sglang, SGLANG_KV_DTYPES),
    ):
        assert mapping.kv_cache_dtype in accepted
        if expected is None:
            assert mapping.preset is None
        else:
            assert (mapping.kv_cache_dtype, mapping.preset is not None) == (expected, True)
            assert mapping.equivalent.layer_pairs(4) == policy.layer_pairs(4)


TURBOQUANT_4BIT = KVPolicy(
    "lloyd4", "int4_tq", group_size=64, rotation="turboquant", tensor_scale="unit",
    boundary_layers=2,
)  # fmt: skip
DEEP = ModelArch("deep", 8, 4, 2, 64, 1 << 30, 8192)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (TURBOQUANT_4BIT, "turboquant_4bit_nc"),
        (TURBOQUANT_4BIT.replace(k_dtype="lloyd3", v_dtype="int3_tq"), "turboquant_3bit_nc"),
        (TURBOQUANT_4BIT.replace(k_dtype="lloyd3"), "turboquant_k3v4_nc"),
        (KVPolicy("fp8", "int4_tq", group_size=64, k_group_size="tensor", boundary_layers=3),
         "turboquant_k8v4"),
        # vLLM would keep the boundary layers exact: not the policy's cache.
        (TURBOQUANT_4BIT.replace(boundary_layers=0), None),
        (TURBOQUANT_4BIT.replace(boundary_layers=1), None),
        (TURBOQUANT_4BIT.replace(rotation="hadamard"), None),
        (KVPolicy("fp8", "int4_tq", group_size=64, boundary_layers=2), None),
    ],
)  # fmt: skip
def test_turboquant_needs_its_boundary_layers_exact(policy, expected):
    mapping = vllm_mapping(policy, DEEP)
    assert mapping.kv_cache_dtype in VLLM_KV_DTYPES
    if expected is None:
        assert mapping.preset is None
        return
    edge = policy.boundary_layers
    assert (mapping.kv_cache_dtype, mapping.preset) == (expected, f"vllm/{expected}")
    assert mapping.skip_layers == (*range(edge), *range(8 - edge, 8))
    assert sglang_mapping(policy, DEEP).preset is None


def test_vllm_skips_exact_layers_of_an_engine_format_and_sglang_cannot():
    pairs = ("fp16/fp16", "fp8/fp8", "fp8/fp8", "bf16/bf16")
    policy = KVPolicy(layer_dtypes=pairs, group_size=64, scale_dtype="fp32")
    vllm = vllm_mapping(policy, ARCH)
    assert (vllm.kv_cache_dtype, vllm.skip_layers, vllm.preset) == (
        "fp8_per_token_head",
        (0, 3),
        "vllm/fp8_per_token_head",
    )
    assert sglang_mapping(policy, ARCH).preset is None


def test_notes_say_when_an_engine_config_is_not_the_measured_cache(tmp_path):
    # fp8 with fp16 scales per 16: vLLM's nearest (per-tensor fp8) stores fewer bytes, so it is
    # not the cache the trial measured and the notes must not vouch for its accuracy.
    setup = smollm_chat_setup()
    policy = KVPolicy("fp8", "fp8", group_size=16)
    trial = TrialRecord(1, "COMPLETE", policy, {"accuracy_retention": 0.98}, True, None, None)
    write_export(tmp_path, trial, setup, build_device(preset("device", "cpu")), "s", "knee")
    notes = (tmp_path / "NOTES.md").read_text()
    # Per vector of 64: fp8 per tensor 64 B against 64 + 4 fp16 scales = 72 B.
    ratio = 64 / 72
    assert (
        f"- vLLM: kv-cache-dtype fp8_e4m3: the nearest config, not this policy's cache. It "
        f"stores {ratio:.2f}x the policy's bytes (fewer)"
    ) in notes
    assert "carries over" not in notes and "at least the policy's precision" not in notes
    assert "fp8: FP8 E4M3 codes; fp16 scales, one per group of 16; exported as FP8" in notes


def test_notes_vouch_for_an_engine_storing_the_measured_codes(tmp_path):
    setup = smollm_chat_setup()
    policy = KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3", tensor_scale="unit")
    trial = TrialRecord(1, "COMPLETE", policy, {"accuracy_retention": 0.9}, True, None, None)
    write_export(tmp_path, trial, setup, build_device(preset("device", "cpu")), "s", "knee")
    notes = (tmp_path / "NOTES.md").read_text()
    for engine, preset_name in (("vLLM", "vllm/nvfp4"), ("SGLang", "sglang/nvfp4")):
        assert (
            f"- {engine}: kv-cache-dtype nvfp4: the same codes as this policy (preset "
            f"`{preset_name}`), so the accuracy measured here carries over."
        ) in notes
    assert "- nothing: the engines store this policy as is" in notes


def preset_trial(number: int, name: str, policy: KVPolicy, retention: float) -> TrialRecord:
    metrics = {"accuracy_retention": retention, "exact_match_retention": 1.0}
    return TrialRecord(number, "COMPLETE", policy, metrics, True, None, name)


def test_export_serves_the_cheapest_engine_preset_measured_at_least_as_accurate(tmp_path):
    # The picked policy (fp8 with fp16 scales per 16, 72 B a vector) measured 0.95. Of the
    # engine presets the study measured, vllm/nvfp4 (36 B, fewer bytes than the policy) and
    # vllm/fp8 (64 B) are at least as accurate; the cheaper one serves. SGLang's only measured
    # preset fell short, so SGLang keeps the rule's nearest config.
    setup = smollm_chat_setup()
    policy = KVPolicy("fp8", "fp8", group_size=16)
    picked = TrialRecord(4, "COMPLETE", policy, {"accuracy_retention": 0.95}, True, None, None)
    nvfp4 = KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3", tensor_scale="unit")
    records = [
        picked,
        preset_trial(6, "vllm/fp8", KVPolicy("fp8", "fp8", group_size="tensor"), 0.97),
        preset_trial(7, "vllm/nvfp4", nvfp4, 0.96),
        preset_trial(8, "vllm/int8_per_token_head", KVPolicy("fp16", "fp16"), 0.94),
        preset_trial(9, "sglang/nvfp4", nvfp4, 0.90),
    ]
    device = build_device(preset("device", "cpu"))
    write_export(tmp_path, picked, setup, device, "s", "knee", records)
    vllm = yaml.safe_load((tmp_path / "vllm.yaml").read_text())
    assert vllm["kv-cache-dtype"] == "nvfp4"
    sglang = (tmp_path / "sglang.args").read_text()
    assert "--kv-cache-dtype fp8_e4m3" in sglang
    notes = (tmp_path / "NOTES.md").read_text()
    # nvfp4: 32 B of codes + 4 E4M3 scales = 36 B a vector against the policy's 72 B.
    assert (
        "- vLLM: kv-cache-dtype nvfp4: not this policy's cache, but this study measured it at "
        "least as accurate (trial 7, preset `vllm/nvfp4`): retention 0.960 against the "
        "policy's 0.950, at 0.50x the policy's bytes (fewer)."
    ) in notes
    assert "| `sglang/nvfp4` | 9 | 0.900 | 1.000 |" in notes
    assert "| this policy | 4 | 0.950 | - |" in notes


def test_a_host_tier_exports_the_engines_prefix_offloading_sized_to_its_host_memory(tmp_path):
    # Units from the engines' sources: vLLM's kv_offloading_size is GiB (x 2^30 bytes, a
    # float), SGLang's hicache_size whole GB (x 10^9 bytes).
    setup = smollm_chat_setup()
    context = 4096
    setup = dataclasses.replace(
        setup, serve=ServeSettings(max_model_len=8192, expected_context_len=context)
    )
    device = build_device(preset("device", "h200-141gb"))
    policy = KVPolicy("fp8", "fp8", group_size="tensor", csa_ratio=8, csa_topk=8, csa_host=True)
    trial = TrialRecord(2, "COMPLETE", policy, {"accuracy_retention": 0.97}, True, None, None)
    write_export(tmp_path, trial, setup, device, "s", "knee")
    vllm = yaml.safe_load((tmp_path / "vllm.yaml").read_text())
    sglang = (tmp_path / "sglang.args").read_text().splitlines()
    running = int(next(line for line in sglang if line.startswith("--max-running-")).split()[1])
    # The host tier holds every block older than the sinks and the window, exact, in every
    # layer: SmolLM2's 30 layers x 3 KV heads x 64 dims x (K, V), 1 B an fp8 element.
    older_blocks = (context - policy.csa_sinks - policy.csa_window) // policy.block_size
    per_sequence = older_blocks * policy.block_size * 30 * 3 * 64 * 2
    assert set(vllm) <= VLLM_KEYS | VLLM_OFFLOAD_KEYS
    assert vllm["kv-offloading-backend"] == "native"
    gib = vllm["max-num-seqs"] * per_sequence / 2**30
    assert gib <= vllm["kv-offloading-size"] < gib + 0.01
    gb = running * per_sequence / 1e9
    assert sglang[-2:] == ["--enable-hierarchical-cache", f"--hicache-size {math.ceil(gb)}"]
    notes = (tmp_path / "NOTES.md").read_text()
    assert "## Nearest settings for the host tier" in notes
    assert f"- vLLM: kv-offloading-size {vllm['kv-offloading-size']} (GiB)" in notes
    assert "no concurrency is gained" in notes and "only for DeepSeek sparse-attention" in notes
    # Without a host tier nothing is offloaded.
    plain = TrialRecord(3, "COMPLETE", KVPolicy(), {"accuracy_retention": 1.0}, True, None, None)
    write_export(tmp_path / "plain", plain, setup, device, "s", "knee")
    assert not set(yaml.safe_load((tmp_path / "plain" / "vllm.yaml").read_text())) - VLLM_KEYS
    assert "hicache" not in (tmp_path / "plain" / "sglang.args").read_text()
    assert "host tier" not in (tmp_path / "plain" / "NOTES.md").read_text()


# llama-server's options an export may write, and the cache types it accepts (llama.cpp
# 0c1e570, common/arg.cpp: kv_cache_types, --flash-attn [on|off|auto]; docs/engine_formats.md).
LLAMACPP_OPTIONS = {"--cache-type-k", "--cache-type-v", "--flash-attn", "--ctx-size", "--parallel"}
LLAMACPP_TYPES = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}
LLAMACPP_QUANTIZED = LLAMACPP_TYPES - {"f32", "f16", "bf16"}
FP32_ARCH = ModelArch("fp32", 4, 4, 2, 64, 1 << 30, 8192, dtype="fp32")


def llamacpp(dtypes: str, **fields) -> KVPolicy:
    k, v = dtypes.split("/")
    return KVPolicy(k, v, **{"group_size": 32, "rotation": "llamacpp", **fields})


@pytest.mark.parametrize(
    ("policy", "arch", "types", "exact"),
    [
        (llamacpp("q4_0/q4_0"), ARCH, ("q4_0", "q4_0"), True),
        (llamacpp("q8_0/q4_0"), ARCH, ("q8_0", "q4_0"), True),
        (llamacpp("fp16/iq4_nl"), ARCH, ("f16", "iq4_nl"), True),
        (llamacpp("q5_1/bf16", tensor_scale="calibrated"), ARCH, ("q5_1", "bf16"), True),
        (KVPolicy(), ARCH, ("f16", "f16"), True),  # nothing quantized: nothing rotated
        (KVPolicy("auto", "auto"), ARCH, ("bf16", "bf16"), True),
        (KVPolicy("auto", "q4_0", rotation="llamacpp"), FP32_ARCH, ("f32", "q4_0"), True),
        # Near misses: groups of 16, another or no rotation, an fp16 window, per-layer types,
        # per-channel keys.
        (llamacpp("q4_0/q4_0", group_size=16), ARCH, ("q4_0", "q4_0"), False),
        (llamacpp("q4_0/q4_0", rotation="none"), ARCH, ("q4_0", "q4_0"), False),
        (llamacpp("q8_0/fp16", rotation="hadamard"), ARCH, ("q8_0", "f16"), False),
        (llamacpp("q4_0/q4_0", recent_unquantized=64), ARCH, ("q4_0", "q4_0"), False),
        (llamacpp("q4_0/q4_0", boundary_layers=1), ARCH, ("f16", "f16"), False),
        (llamacpp("q4_1/q4_1", k_scale_axis="channel"), ARCH, ("q4_1", "q4_1"), False),
        # Formats llama.cpp lacks: the type of the fewest bits that keeps theirs.
        (KVPolicy("fp8", "fp4", group_size=16), ARCH, ("q8_0", "q4_0"), False),
        (KVPolicy("int4", "int3", group_size=16), ARCH, ("q4_1", "q4_1"), False),
        (KVPolicy("int8", "lloyd4", group_size=64), ARCH, ("q8_0", "q4_0"), False),
        (KVPolicy(layer_dtypes=("fp8/fp4",) * 3 + ("fp16/int2",)), ARCH, ("f16", "q4_1"), False),
    ],
)  # fmt: skip
def test_llamacpp_exports_the_types_storing_the_policy_or_the_nearest(policy, arch, types, exact):
    mapping = llamacpp_mapping(policy, arch)
    assert stream_types(mapping.equivalent, arch) == types
    assert set(types) <= LLAMACPP_TYPES
    assert (mapping.preset is not None) == exact
    assert (llamacpp_gaps(policy, arch) == []) == exact
    if exact:
        assert mapping.equivalent == policy
    else:  # llama.cpp keeps every token in its types: one type a stream, rotated its way
        equivalent = mapping.equivalent
        assert not equivalent.compressed and equivalent.recent_unquantized == 0
        assert (equivalent.group_size, equivalent.rotation) == (32, "llamacpp")
    args = llama_server_args(mapping.equivalent, arch, 3, SERVE)
    options = dict(line.split(" ", 1) for line in args)
    assert set(options) <= LLAMACPP_OPTIONS
    assert (options["--cache-type-k"], options["--cache-type-v"]) == types
    assert ("--flash-attn" in options) == (types[1] in LLAMACPP_QUANTIZED)
    assert options.get("--flash-attn", "on") == "on"


def test_llamacpp_gaps_name_what_it_cannot_store():
    policy = KVPolicy(
        layer_dtypes=("fp16/fp16", "q4_0/fp4", "q4_0/fp4", "q4_0/fp4"),
        group_size=16,
        k_scale_axis="channel",
        rotation="hadamard",
        recent_unquantized=32,
    )
    gaps = "\n".join(llamacpp_gaps(policy, ARCH))
    assert "per-layer K dtypes (fp16, q4_0): llama.cpp has one --cache-type-k" in gaps
    assert "per-layer V dtypes (fp16, fp4)" in gaps
    assert "fp4 (FP4 E2M1 codes): llama.cpp has no such type (exported as q4_0)" in gaps
    assert "per-channel key scales" in gaps
    assert "the hadamard rotation of q4_0" in gaps
    assert "the 32 most recent tokens kept in fp16" in gaps
    assert "CSA compression" not in gaps
    compressed = policy.replace(csa_ratio=4, k_scale_axis="token")
    assert "CSA compression" in "\n".join(llamacpp_gaps(compressed, ARCH))
    grouped = llamacpp_gaps(llamacpp("q4_0/q8_0", group_size=64, k_group_size=32), ARCH)
    assert grouped == ["q8_0 values in groups of 64: llama.cpp's blocks are 32"]
    unrotated = llamacpp_gaps(llamacpp("q4_0/fp16", rotation="none"), ARCH)
    assert len(unrotated) == 1 and "LLAMA_ATTN_ROT_DISABLE=1" in unrotated[0]


def test_llama_server_is_sized_for_the_target_device(tmp_path):
    """--parallel: slots of the workload's context rounded up to 256 that the device fits
    (at most llama.cpp's 256 sequences); --ctx-size: their total."""
    setup = smollm_chat_setup()
    policy = llamacpp("q8_0/q4_0")
    trial = TrialRecord(2, "COMPLETE", policy, {"accuracy_retention": 0.97}, True, None, None)
    slot = -(-setup.workload.context_len // 256) * 256
    # SmolLM2: 30 layers x 3 KV heads x 2 blocks of 32 x (q8_0's 34 B + q4_0's 18 B).
    per_slot = 30 * 3 * 2 * (34 + 18) * slot
    for device, slots in (
        (DeviceSpec("cpu", 2, 100), None),
        (build_device(preset("device", "l4-24gb")), 256),
    ):
        name = device.name
        write_export(tmp_path / name, trial, setup, device, "s", "knee")
        lines = (tmp_path / name / "llama-server.args").read_text().splitlines()
        options = dict(line.split(" ", 1) for line in lines)
        budget = int(device.memory_gib * GIB * 0.9 - setup.arch.weights_bytes - GIB)
        expected = slots or budget // per_slot
        assert slots or 1 < expected < 256  # the 2 GiB device fits fewer than llama.cpp takes
        assert int(options["--parallel"]) == expected
        assert int(options["--ctx-size"]) == expected * slot
        assert lines[:3] == ["--cache-type-k q8_0", "--cache-type-v q4_0", "--flash-attn on"]
    assert budget // per_slot > 256  # the L4 fits more than llama.cpp takes
    notes = (tmp_path / "cpu" / "NOTES.md").read_text()
    assert (
        "- llama.cpp: --cache-type-k q8_0 --cache-type-v q4_0: the same codes as this policy (K "
        "as preset `llamacpp/q8_0`, V as preset `llamacpp/q4_0`), so the accuracy measured here "
        "carries over."
    ) in notes
    assert "## What llama.cpp cannot express\n\n- nothing: llama.cpp stores this policy" in notes
    assert "| llama.cpp nearest |" in notes


def test_llamacpp_serves_its_cheapest_preset_measured_at_least_as_accurate(tmp_path):
    setup = smollm_chat_setup()
    policy = KVPolicy("int4", "int4", group_size=16)
    picked = TrialRecord(4, "COMPLETE", policy, {"accuracy_retention": 0.95}, True, None, None)
    records = [
        picked,
        preset_trial(6, "llamacpp/q8_0", llamacpp("q8_0/q8_0"), 0.99),
        preset_trial(7, "llamacpp/q5_1", llamacpp("q5_1/q5_1"), 0.96),
        preset_trial(8, "llamacpp/q4_0", llamacpp("q4_0/q4_0"), 0.90),
    ]
    write_export(tmp_path, picked, setup, build_device(preset("device", "cpu")), "s", "knee")
    nearest = (tmp_path / "llama-server.args").read_text()
    assert "--cache-type-k q4_1\n--cache-type-v q4_1\n" in nearest  # int4: a zero point
    write_export(
        tmp_path, picked, setup, build_device(preset("device", "cpu")), "s", "knee", records
    )
    served = (tmp_path / "llama-server.args").read_text()
    assert served.startswith("--cache-type-k q5_1\n--cache-type-v q5_1\n--flash-attn on\n")
    notes = (tmp_path / "NOTES.md").read_text()
    # q5_1: 24 B a block of 32 against int4 g16's 16 + 2 x 2 fp16 pairs = 24 B: equal bytes.
    assert (
        "- llama.cpp: --cache-type-k q5_1 --cache-type-v q5_1: not this policy's cache, but this "
        "study measured it at least as accurate (trial 7, preset `llamacpp/q5_1`): retention "
        "0.960 against the policy's 0.950, at 1.00x the policy's bytes (more)."
    ) in notes
    assert "| `llamacpp/q4_0` | 8 | 0.900 | 1.000 |" in notes
