"""KVPolicy validation and its dict/YAML round trip."""

from pathlib import Path

import pytest
import yaml

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy

SMOL = ModelArch("smol", 30, 9, 3, 64, 0, 8192)
MLA = ModelArch("mla", 4, 16, 16, 192, 0, 4096, kv_lora_rank=512, qk_rope_head_dim=64)
CONF_POLICY = Path(__file__).resolve().parents[2] / "conf" / "policy" / "default.yaml"
# Selection without summaries, every knob but the budget set.
SELECTING = {"csa_ratio": 2, "csa_summary": "none", "csa_host": True}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"k_dtype": "int5"}, "policy.k_dtype"),
        ({"v_dtype": "fp6"}, "policy.v_dtype"),
        ({"layer_dtypes": ["fp8/fp4", "fp8"]}, "policy.layer_dtypes[1]"),
        ({"layer_dtypes": ["fp8/int16"]}, "policy.layer_dtypes[0]"),
        ({"k_dtype": "int4", "group_size": "tensor"}, "policy.group_size"),
        ({"layer_dtypes": ["fp8/int2"], "group_size": "tensor"}, "policy.group_size"),
        ({"v_dtype": "int8", "scale_dtype": "e4m3"}, "policy.scale_dtype"),
        ({"rotation": "givens"}, "policy.rotation"),
        ({"rotation": None}, "policy.rotation"),
        ({"layer_dtypes": "fp8/fp4"}, "policy.layer_dtypes"),
        ({"group_size": 0}, "policy.group_size"),
        ({"group_size": "row"}, "policy.group_size"),
        ({"scale_dtype": "fp64"}, "policy.scale_dtype"),
        ({"recent_unquantized": -1}, "policy.recent_unquantized"),
        ({"csa_ratio": 3}, "policy.csa_ratio"),
        ({"csa_ratio": 32, "block_size": 16}, "policy.csa_ratio"),
        ({"csa_window": -5}, "policy.csa_window"),
        ({"csa_sinks": -1}, "policy.csa_sinks"),
        ({"csa_ratio": 4, "csa_window": 8, "block_size": 16}, "policy.csa_window"),
        ({"block_size": 12}, "policy.block_size"),
        ({"block_size": True}, "policy.block_size"),
        ({"chunk_size": 100}, "policy.chunk_size"),
        ({"chunk_size": 0}, "policy.chunk_size"),
        ({"k_group_size": 0}, "policy.k_group_size"),
        ({"k_dtype": "int3", "k_group_size": "tensor"}, "policy.k_group_size"),
        ({"v_dtype": "int3_tq", "group_size": "tensor", "k_group_size": 64}, "policy.group_size"),
        ({"k_dtype": "lloyd4", "scale_dtype": "e4m3"}, "policy.scale_dtype"),
        ({"k_dtype": "lloyd3", "k_scale_axis": "channel"}, "policy.k_scale_axis"),
        ({"csa_summary": "max"}, "policy.csa_summary"),
        ({"csa_ratio": 4, "csa_summary": "none"}, "policy.csa_summary"),
        (
            {
                "csa_ratio": 4,
                "csa_summary": "none",
                "csa_topk": 8,
                "csa_host": True,
                "csa_index": "summaries",
            },
            "policy.csa_summary",
        ),
        ({"csa_ratio": 4, "csa_index": "means", "csa_summary": "none"}, "policy.csa_summary"),
        ({"csa_index": "max"}, "policy.csa_index"),
        (
            {"csa_ratio": 4, "csa_topk": 8, "csa_host": True, "csa_staging": "pinned"},
            "policy.csa_staging",
        ),
        ({"csa_ratio": 4, "csa_staging": "streamed"}, "policy.csa_staging"),
        (
            {"csa_ratio": 4, "csa_topk": 8, "csa_host": True, "csa_select_every": 0},
            "policy.csa_select_every",
        ),
        ({"csa_ratio": 4, "csa_select_every": 4}, "policy.csa_select_every"),
        ({"csa_ratio": 4, "csa_topk": 8, "csa_host": True, "csa_rescore": 0}, "policy.csa_rescore"),
        ({"csa_ratio": 4, "csa_rescore": 4}, "policy.csa_rescore"),
        (
            {"csa_ratio": 4, "csa_topk": 8, "csa_host": True, "layer_csa_select_every": [0, 2]},
            "policy.layer_csa_select_every[0]",
        ),
        ({"csa_ratio": 4, "layer_csa_select_every": [1, 4]}, "policy.layer_csa_select_every"),
        (
            {
                "csa_ratio": 4,
                "csa_topk": 8,
                "csa_host": True,
                "csa_select_every": 2,
                "layer_csa_select_every": [1, 4],
            },
            "policy.csa_select_every",
        ),
        ({"csa_index_dtype": "fp4"}, "policy.csa_index_dtype"),
        ({"csa_ratio": 4, "csa_index_dtype": "int4"}, "policy.csa_index_dtype"),
        (
            {
                "csa_ratio": 4,
                "csa_topk": 8,
                "csa_host": True,
                "csa_index": "summaries",
                "csa_index_dtype": "fp8",
            },
            "policy.csa_index_dtype",
        ),
        # Per-channel keys beside compression: only without summaries, bounds in an index.
        ({"k_dtype": "int4", "k_scale_axis": "channel", "csa_ratio": 4}, "policy.k_scale_axis"),
        (
            {
                "k_dtype": "int4",
                "k_scale_axis": "channel",
                "csa_ratio": 2,
                "csa_summary": "none",
                "csa_topk": 8,
                "csa_host": True,
            },
            "policy.k_scale_axis",
        ),
        (
            {
                "k_dtype": "int4",
                "k_scale_axis": "channel",
                "csa_ratio": 2,
                "csa_topk": 8,
                "csa_host": True,
                "csa_index_dtype": "int4",
            },
            "policy.k_scale_axis",
        ),
        ({"boundary_layers": -1}, "policy.boundary_layers"),
        # Per-layer selection budgets: integers, one above 0, csa_topk their largest or 0.
        ({**SELECTING, "layer_csa_topk": "8"}, "policy.layer_csa_topk"),
        ({**SELECTING, "layer_csa_topk": [8, -1]}, "policy.layer_csa_topk[1]"),
        ({**SELECTING, "layer_csa_topk": [8, 2.5]}, "policy.layer_csa_topk[1]"),
        ({**SELECTING, "layer_csa_topk": [0, 0]}, "policy.layer_csa_topk"),
        ({**SELECTING, "layer_csa_topk": [4, 2], "csa_topk": 8}, "policy.csa_topk"),
        ({"layer_csa_topk": [4, 2]}, "policy.layer_csa_topk"),
        ({"boundary_layers": True}, "policy.boundary_layers"),
    ],
)
def test_invalid_field_is_named_with_value_and_allowed(changes, field):
    with pytest.raises(ConfigError) as error:
        KVPolicy(**changes)
    message = str(error.value)
    assert message.startswith(f"{field}=")
    assert "\n" not in message
    assert error.value.field == field


def test_window_may_be_small_without_compression():
    assert KVPolicy(csa_ratio=1, csa_window=0, csa_sinks=0).csa_window == 0


def test_group_size_must_divide_the_models_head_dim():
    KVPolicy(k_dtype="fp8", group_size=32).check_model(SMOL)
    with pytest.raises(ConfigError, match=r"policy.group_size=48 .*head_dim=64"):
        KVPolicy(k_dtype="fp8", group_size=48).check_model(SMOL)
    with pytest.raises(ConfigError, match=r"policy.group_size=128 .*head_dim=64"):
        KVPolicy(v_dtype="fp4", group_size=128).check_model(SMOL)
    # Refused even when no stream is quantized: every field is checked every time.
    with pytest.raises(ConfigError, match=r"policy.group_size=48 .*head_dim=64"):
        KVPolicy(group_size=48).check_model(SMOL)
    KVPolicy(group_size="tensor").check_model(SMOL)


def test_layer_dtypes_need_one_pair_per_layer():
    with pytest.raises(ConfigError, match="30 layers"):
        KVPolicy(layer_dtypes=("fp8/fp4",) * 29).check_model(SMOL)
    pairs = KVPolicy(k_dtype="fp8", layer_dtypes=("fp16/fp4",) * 30).layer_pairs(30)
    assert pairs[0] == ("fp16", "fp4") and len(pairs) == 30


def test_mla_caches_one_latent_so_k_and_v_share_a_dtype():
    KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=64).check_model(MLA)
    with pytest.raises(ConfigError, match="policy.v_dtype"):
        KVPolicy(k_dtype="fp8", v_dtype="fp4").check_model(MLA)


def test_rotation_needs_a_power_of_two_head_dim_and_per_head_vectors():
    KVPolicy(k_dtype="int4", rotation="hadamard").check_model(SMOL)
    odd = ModelArch("odd", 2, 4, 2, 96, 0, 4096)
    with pytest.raises(ConfigError, match=r"policy.rotation='hadamard' .*head_dim=96"):
        KVPolicy(k_dtype="int4", rotation="hadamard").check_model(odd)
    KVPolicy(k_dtype="int4", rotation="none").check_model(odd)
    with pytest.raises(ConfigError, match=r"policy.rotation='hadamard' .*latent"):
        KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=64, rotation="hadamard").check_model(MLA)


def test_whole_vector_codes_need_head_dim_groups_for_their_stream():
    KVPolicy(k_dtype="lloyd4", v_dtype="int4_tq", group_size=64).check_model(SMOL)
    KVPolicy(k_dtype="lloyd3", v_dtype="int4", group_size=32, k_group_size=64).check_model(SMOL)
    with pytest.raises(ConfigError, match=r"policy.k_group_size=32 .*head_dim=64 with lloyd3"):
        KVPolicy(k_dtype="lloyd3", group_size=64, k_group_size=32).check_model(SMOL)
    with pytest.raises(ConfigError, match=r"policy.group_size=32 .*head_dim=64 with lloyd4"):
        KVPolicy(v_dtype="lloyd4", group_size=32).check_model(SMOL)
    with pytest.raises(ConfigError, match=r"policy.k_group_size=48 .*must divide head_dim=64"):
        KVPolicy(k_group_size=48).check_model(SMOL)


def test_keys_may_group_apart_from_values():
    policy = KVPolicy(k_dtype="fp8", v_dtype="int4_tq", group_size=64, k_group_size="tensor")
    assert policy.kv_format("fp8", "bf16", keys=True) == KVFormat("fp8", None)
    assert policy.kv_format("int4_tq", "bf16") == KVFormat("int4_tq", 64)
    assert KVPolicy(group_size=16).key_group_size == 16


def test_boundary_layers_keep_fp16_at_both_ends_at_most_half_the_model():
    policy = KVPolicy(k_dtype="int4", v_dtype="int4", boundary_layers=2)
    int4 = ("int4", "int4")
    assert policy.layer_pairs(6) == [("fp16", "fp16")] * 2 + [int4] * 2 + [("fp16", "fp16")] * 2
    assert policy.layer_pairs(3) == [("fp16", "fp16"), int4, ("fp16", "fp16")]
    assert policy.replace(boundary_layers=9).layer_pairs(4) == [("fp16", "fp16")] * 4
    overridden = policy.replace(layer_dtypes=("fp8/fp4",) * 5)
    assert (
        overridden.layer_pairs(5)
        == [("fp16", "fp16")] * 2 + [("fp8", "fp4")] + [("fp16", "fp16")] * 2
    )


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("int4", KVFormat("int4", 32, "fp16")),
        ("int8", KVFormat("int8", 32, "fp16")),
        ("int2", KVFormat("int2", 32, "fp16")),
        ("auto", KVFormat("bf16")),
    ],
)
def test_kv_format_of_integer_dtypes(dtype, expected):
    assert KVPolicy(k_dtype="int4", v_dtype="int2").kv_format(dtype, "bf16") == expected


def test_round_trips_through_dict_and_yaml():
    policy = KVPolicy(
        k_dtype="fp8",
        v_dtype="fp4",
        layer_dtypes=("fp8/fp4", "fp16/fp8"),
        group_size="tensor",
        scale_dtype="e4m3",
        recent_unquantized=64,
        csa_ratio=4,
        csa_window=256,
        csa_sinks=4,
        block_size=32,
        chunk_size=256,
    )
    assert KVPolicy.from_dict(policy.to_dict()) == policy
    assert KVPolicy.from_yaml(policy.to_yaml()) == policy
    assert yaml.safe_load(policy.to_yaml())["layer_dtypes"] == ["fp8/fp4", "fp16/fp8"]
    integer = KVPolicy(
        k_dtype="int4", v_dtype="int2", layer_dtypes=("int8/int4",), rotation="hadamard"
    )
    assert KVPolicy.from_dict(integer.to_dict()) == integer
    assert KVPolicy.from_yaml(integer.to_yaml()) == integer
    assert yaml.safe_load(integer.to_yaml())["rotation"] == "hadamard"
    budgets = KVPolicy(**SELECTING, layer_csa_topk=[0, 16, 8])
    assert budgets.csa_topk == 16 and budgets.layer_csa_topk == (0, 16, 8)
    assert KVPolicy.from_yaml(budgets.to_yaml()) == budgets
    assert yaml.safe_load(budgets.to_yaml())["layer_csa_topk"] == [0, 16, 8]


def test_per_layer_budgets_need_one_a_layer():
    budgets = KVPolicy(**SELECTING, layer_csa_topk=[8] * 29 + [16], csa_topk=16)
    assert budgets.layer_topk(30) == [8] * 29 + [16]
    assert KVPolicy(**SELECTING, csa_topk=4).layer_topk(3) == [4, 4, 4]
    with pytest.raises(ConfigError, match=r"policy.layer_csa_topk='<2 entries>' .*30 layers"):
        KVPolicy(**SELECTING, layer_csa_topk=[8, 16]).check_model(SMOL)


def test_numeric_strings_for_group_size_are_accepted():
    assert KVPolicy(group_size="16").group_size == 16


def test_unknown_key_is_refused_with_the_known_fields():
    with pytest.raises(ConfigError, match=r"policy.k_dtyp=.*known: .*k_dtype"):
        KVPolicy.from_dict({"k_dtyp": "fp8"})


def test_hydra_default_matches_the_dataclass_default():
    assert yaml.safe_load(CONF_POLICY.read_text()) == KVPolicy().to_dict()


def test_per_channel_keys_sit_beside_selection_with_bounds_in_a_separate_index():
    policy = KVPolicy(
        k_dtype="int4",
        v_dtype="int4",
        group_size=64,
        k_scale_axis="channel",
        rotation="hadamard",
        csa_ratio=2,
        csa_window=128,
        csa_summary="none",
        csa_topk=40,
        csa_host=True,
        csa_index_dtype="int4",
    )
    policy.check_model(SMOL)
    odd = ModelArch("odd", 2, 4, 2, 80, 0, 4096)
    with pytest.raises(ConfigError, match=r"policy.csa_index_dtype='int4' .*head_dim=80"):
        policy.replace(rotation="none", group_size=16).check_model(odd)
    with pytest.raises(ConfigError, match=r"policy.csa_index_dtype='int4' .*MLA"):
        policy.replace(
            k_dtype="fp8", v_dtype="fp8", k_scale_axis="token", rotation="none"
        ).check_model(MLA)
