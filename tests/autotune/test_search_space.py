"""The search space: config validation, valid draws only, warm starts, canonical policies."""

import optuna
import pytest

from kvtune.autotune.search.attention_profile import AttentionProfile, Geometry
from kvtune.autotune.search.profiles import Profiles
from kvtune.autotune.search.sensitivity import group_layers
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy, canonical

ARCH = ModelArch(
    name="test",
    num_layers=6,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=64,
    weights_bytes=1 << 30,
    max_position_embeddings=8192,
)
SEARCH = {
    "layer_groups": 3,
    "k_dtype": ["fp16", "fp8", "fp4"],
    "v_dtype": ["fp16", "fp8", "fp4"],
    "group_size": [16, 32, "tensor"],
    "scale_dtype": ["fp16", "e4m3"],
    "recent_unquantized": [0, 64],
    "csa_ratio": [1, 2, 4, 8],
    "csa_window": [128, 512],
    "csa_sinks": [4, 16],
    "block_size": [8, 16, 32, 64, 128],
    "chunk_size": [256, 512],
}
GROUPS = ((0, 1), (2, 3), (4, 5))


def space(**changes) -> SearchSpace:
    config = SearchConfig.from_dict({**SEARCH, **changes}, ARCH)
    return SearchSpace(config, GROUPS, ARCH.num_layers)


def valid_draws(search: SearchSpace, count: int, seed: int) -> list[KVPolicy]:
    """count random draws of the space, each checked against the model."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    policies = []
    for _ in range(count):
        trial = study.ask()
        policy = search.suggest(trial)
        policy.check_model(ARCH)
        policies.append(policy)
        study.tell(trial, 0.0)
    return policies


def test_every_draw_is_a_valid_policy_for_the_model():
    search = space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(300):
        trial = study.ask()
        policy = search.suggest(trial)
        policy.check_model(ARCH)
        assert policy.chunk_size % policy.block_size == 0
        assert policy.csa_ratio <= policy.block_size
        assert kv_bytes_per_sequence(ARCH, policy, 4096) > 0
        study.tell(trial, 0.0)


def test_params_are_per_group_dtypes_and_multi_candidate_knobs():
    search = space(csa_sinks=16)
    params = search.distributions()
    assert "csa_sinks" not in params  # one candidate: fixed, not searched
    assert {f"k_dtype_g{i}" for i in range(3)} <= set(params)
    assert params["block_size"].choices == (8, 16, 32, 64, 128)
    policy = search.policy({"k_dtype_g0": "fp4", "v_dtype_g0": "fp8", "csa_ratio": 1})
    assert policy.layer_pairs(6)[:2] == [("fp4", "fp8")] * 2
    assert policy.csa_sinks == KVPolicy().csa_sinks  # canonical: no compression, default sinks


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"chunk_size": [256, 200]}, "search.chunk_size"),
        ({"chunk_size": [64]}, "search.chunk_size"),  # not a multiple of block 128
        ({"csa_ratio": [1, 16]}, "search.csa_ratio"),  # > smallest block 8
        ({"csa_window": [64]}, "search.csa_window"),  # < largest block 128 with compression
        ({"group_size": [16, 48]}, "search.group_size"),  # does not divide head_dim 64
        ({"k_dtype": ["fp16", "int5"]}, "search.k_dtype"),
        ({"v_dtype": ["fp16", "int4"], "scale_dtype": ["e4m3"]}, "search.v_dtype"),
        ({"k_dtype": ["fp16", "int3"], "group_size": ["tensor"]}, "search.k_dtype"),
        ({"rotation": ["none", "givens"]}, "search.rotation"),
        ({"layer_groups": 7}, "search.layer_groups"),
        ({"layer_groups": "some"}, "search.layer_groups"),
        ({"block_size": [16, 24]}, "search.block_size"),
        ({"scale_dtype": []}, "search.scale_dtype"),
        ({"csa_sinks": [4, 4]}, "search.csa_sinks"),
        ({"recent_unqantized": [0]}, "search.recent_unqantized"),
        ({"csa_topk_share": [0.5, 1.5]}, "search.csa_topk_share"),
        ({"csa_topk_share": ["half"]}, "search.csa_topk_share"),
    ],
)
def test_bad_knobs_fail_naming_the_field(changes, field):
    with pytest.raises(ConfigError) as error:
        SearchConfig.from_dict({**SEARCH, **changes}, ARCH)
    assert error.value.field == field


def test_missing_knob_is_named():
    data = dict(SEARCH)
    del data["block_size"]
    with pytest.raises(ConfigError, match="search.block_size"):
        SearchConfig.from_dict(data, ARCH)


def test_without_profiles_the_starts_are_the_baseline_and_4bit_codes():
    starts = space().warm_starts()
    assert list(starts) == ["baseline", "profile-formats"]
    search = space()
    baseline = search.policy(starts["baseline"])
    assert baseline.layer_pairs(6) == [("fp16", "fp16")] * 6 and not baseline.compressed
    assert search.policy(starts["profile-formats"]).layer_pairs(6) == [("fp4", "fp4")] * 6


def test_without_4bit_candidates_only_the_baseline_starts():
    starts = space(k_dtype=["fp16", "fp8"], v_dtype=["fp16", "fp8"]).warm_starts()
    assert list(starts) == ["baseline"]


def test_a_group_whose_fp4_cost_stands_out_starts_at_the_precise_dtype():
    """A dtype group whose mean fp4 cost is over PROTECT_RATIO (4) times the median layer's
    keeps fp16 in the formats start; the others take 4-bit codes."""
    config = SearchConfig.from_dict({**SEARCH, "k_dtype": ["fp16", "int4"]}, ARCH)
    costs = (0.01, 0.02, 0.02, 0.03, 0.05, 0.5)  # median 0.025; groups' means .015 .025 .275
    search = SearchSpace(config, GROUPS, 6, Profiles(sensitivity=costs))
    pairs = search.policy(search.warm_starts()["profile-formats"]).layer_pairs(6)
    assert pairs == [("int4", "fp4")] * 4 + [("fp16", "fp16")] * 2
    flat = (0.01, 0.02, 0.02, 0.03, 0.05, 0.09)  # .07 < 4 x .025: nothing stands out
    search = SearchSpace(config, GROUPS, 6, Profiles(sensitivity=flat))
    pairs = search.policy(search.warm_starts()["profile-formats"]).layer_pairs(6)
    assert pairs == [("int4", "fp4")] * 6


SELECTING = dict(
    k_dtype=["fp16", "int4"],
    v_dtype=["fp16", "int4"],
    group_size=[32, 64],
    scale_dtype=["fp16"],
    k_scale_axis=["token", "channel"],
    rotation=["none", "hadamard"],
    csa_ratio=[1, 2],
    csa_window=[256, 512],
    csa_sinks=[16],
    csa_topk=[0, 16, 48],
    csa_topk_share=[0.5, 1],
    csa_select_every=[1, 4],
    csa_summary=["pre_rope", "none"],
    csa_index_dtype=["auto", "int4"],
    csa_staging=["resident", "streamed"],
    block_size=[16, 32],
    chunk_size=[256],
)


def attention(need, overlap, outlier) -> AttentionProfile:
    return AttentionProfile(
        Geometry(4096, 16, 256, 16), (0.5,) * 6, tuple(need), tuple(overlap), (outlier,) * 6
    )


def test_the_selecting_start_reads_its_budgets_reuse_and_key_axis_off_the_profile():
    """Layers grouped by the blocks they need; csa_topk the neediest layer's need, each group
    its neediest layer's need over that (rounded up to hundredths), reused (4) where its
    choices persist (mean overlap >= 0.8), per-channel keys where the median layer's key
    outliers are >= 2."""
    profile = attention([70, 10, 40, 12, 42, 80], [0.5, 0.9, 0.75, 0.95, 0.9, 0.7], 5.0)
    search = SearchSpace(
        SearchConfig.from_dict({**SEARCH, **SELECTING}, ARCH), GROUPS, 6, Profiles(None, profile)
    )
    assert search.selection_groups == ((1, 3), (2, 4), (0, 5))
    assert search.knobs["csa_topk"] == (0, 16, 48, 80)  # the groups' largest needs: 12, 42, 80
    assert search.distributions()["csa_topk_share_s0"].choices == (0.15, 0.5, 1)  # 12/80
    assert search.distributions()["csa_topk_share_s1"].choices == (0.5, 0.53, 1)  # 42/80
    policy = search.policy(search.warm_starts()["profile-selecting"])
    assert policy.layer_topk(6) == [80, 12, 43, 12, 43, 80]  # ceil(80 x 0.15), ceil(80 x .53)
    assert policy.layer_select_every(6) == [1, 4, 4, 4, 4, 1]
    assert (policy.csa_ratio, policy.csa_window, policy.csa_sinks, policy.block_size) == (
        2,
        256,
        16,
        16,
    )
    assert policy.k_scale_axis == "channel" and policy.csa_summary == "none"
    assert policy.csa_index_dtype == "int4" and policy.rotation == "hadamard"
    assert policy.layer_pairs(6) == [("int4", "int4")] * 6 and policy.csa_staging == "streamed"


def test_two_profiles_give_different_spaces_and_starts():
    config = SearchConfig.from_dict({**SEARCH, **SELECTING}, ARCH)
    local = attention([70, 10, 40, 12, 38, 80], [0.5, 0.9, 0.85, 0.95, 0.9, 0.7], 5.0)
    other = attention([5, 60, 6, 30, 31, 62], [0.9] * 6, 1.2)
    first, second = (SearchSpace(config, GROUPS, 6, Profiles(None, p)) for p in (local, other))
    assert first.selection_groups != second.selection_groups
    assert first.distributions() != second.distributions()
    one, two = (s.policy(s.warm_starts()["profile-selecting"]) for s in (first, second))
    assert one.layer_topk(6) != two.layer_topk(6)
    assert one.layer_select_every(6) != two.layer_select_every(6)
    assert (one.k_scale_axis, two.k_scale_axis) == ("channel", "token")


def test_a_start_whose_knobs_are_not_candidates_is_left_out():
    profile = Profiles(None, attention([70, 10, 40, 12, 38, 80], [0.9] * 6, 5.0))

    def starts(**changes) -> list[str]:
        config = SearchConfig.from_dict({**SEARCH, **SELECTING, **changes}, ARCH)
        return list(SearchSpace(config, GROUPS, 6, profile).warm_starts())

    assert starts(csa_ratio=[1]) == ["baseline", "profile-formats"]  # no compression
    resident = SearchConfig.from_dict({**SEARCH, **SELECTING, "csa_staging": ["resident"]}, ARCH)
    space = SearchSpace(resident, GROUPS, 6, profile)
    assert space.policy(space.warm_starts()["profile-selecting"]).csa_staging == "resident"
    # The profile measured a 256-token window: a space without it takes no selecting start.
    assert "profile-selecting" not in starts(csa_window=[512])


def test_canonical_merges_policies_that_store_the_same_cache():
    a = KVPolicy(group_size=16, scale_dtype="e4m3", csa_window=128, csa_sinks=4)
    b = KVPolicy(group_size="tensor", layer_dtypes=("fp16/fp16",) * 6)
    assert canonical(a) == canonical(b) == KVPolicy(group_size="tensor")  # valid for any head_dim
    quantized = KVPolicy(k_dtype="fp8", v_dtype="fp8", group_size=16)
    assert canonical(quantized).group_size == 16  # scales matter once a stream is quantized


def test_integer_dtypes_draw_valid_policies_with_group_and_fp16_scales():
    search = space(
        k_dtype=["fp16", "int8", "int4"],
        v_dtype=["int4", "int2"],
        group_size=[16, 32],
        scale_dtype=["fp16"],
        rotation=["none", "hadamard"],
    )
    drawn = set()
    for policy in valid_draws(search, 100, seed=2):
        drawn |= {d for pair in policy.layer_pairs(6) for d in pair} | {policy.rotation}
    assert {"int8", "int4", "int2", "none", "hadamard"} <= drawn
    assert search.policy(search.warm_starts()["baseline"]).layer_pairs(6) == [("fp16", "int4")] * 6


def test_hadamard_rotation_needs_a_power_of_two_head_dim():
    odd = ModelArch("odd", 6, 8, 2, 96, 1 << 30, 8192)
    with pytest.raises(ConfigError, match="search.rotation"):
        SearchConfig.from_dict({**SEARCH, "group_size": [16, 32], "rotation": ["hadamard"]}, odd)


def test_canonical_drops_a_rotation_of_an_unquantized_cache():
    assert canonical(KVPolicy(rotation="hadamard")) == canonical(KVPolicy())
    rotated = KVPolicy(k_dtype="int4", v_dtype="int4", rotation="hadamard")
    assert canonical(rotated).rotation == "hadamard"


def test_space_size_counts_combinations():
    config = SearchConfig.from_dict(SEARCH, ARCH)
    assert config.size(3) == 3 * 2 * 2 * 4 * 2 * 2 * 5 * 2 * 9**3
    # A share drawn per group multiplies each group's K x V choices.
    shares = SearchConfig.from_dict({**SEARCH, "csa_topk_share": [0.5, 1]}, ARCH)
    assert shares.size(3) == 3 * 2 * 2 * 4 * 2 * 2 * 5 * 2 * (9 * 2) ** 3
    reuse = SearchConfig.from_dict({**SEARCH, "csa_select_every": [1, 2, 4]}, ARCH)
    assert reuse.size(3) == 3 * 2 * 2 * 4 * 2 * 2 * 5 * 2 * (9 * 3) ** 3


def test_each_layer_group_reads_its_share_of_the_selection_budget():
    """csa_topk_share is drawn per layer group: a layer of group g reads ceil(csa_topk x
    share_g) blocks, csa_topk becomes the largest of them (the staging pool), equal budgets
    are the plain csa_topk, and all-zero shares select nothing."""
    search = space(
        csa_ratio=[2],
        csa_window=[256],
        csa_topk=[48],
        csa_topk_share=[0, 0.25, 1],
        csa_summary=["none"],
        block_size=[16],
        chunk_size=[256],
    )
    assert {f"csa_topk_share_s{i}" for i in range(3)} <= set(search.distributions())
    assert "csa_topk_share" not in search.distributions()
    params = {"csa_topk_share_s0": 0.25, "csa_topk_share_s1": 0, "csa_topk_share_s2": 0.25}
    pyramid = search.policy(params)
    assert pyramid.layer_csa_topk == (12, 12, 0, 0, 12, 12) and pyramid.csa_topk == 12
    assert pyramid.csa_host and pyramid.csa_summary == "none"
    uniform = search.policy({f"csa_topk_share_s{i}": 1 for i in range(3)})
    assert uniform.layer_csa_topk is None and uniform.csa_topk == 48
    nothing = search.policy({f"csa_topk_share_s{i}": 0 for i in range(3)})
    assert not nothing.selects and not nothing.csa_host and nothing.csa_summary == "pre_rope"
    draws = valid_draws(search, 60, seed=4)
    assert any(p.layer_csa_topk is not None for p in draws)
    for drawn in draws:
        budgets = drawn.layer_topk(6)
        assert set(budgets) <= {0, 12, 48} and drawn.csa_topk == max(budgets)
    # Without the knob every group reads the whole budget.
    assert (
        space(csa_ratio=[2], csa_topk=[0, 8], csa_window=[256])
        .policy({"csa_topk": 8})
        .layer_csa_topk
        is None
    )


def test_each_layer_group_reuses_its_choice_for_its_own_positions():
    """csa_select_every is drawn per layer group like the budget share: a layer of group g
    reuses each choice for N_g positions, csa_select_every becomes their largest, a group
    that selects nothing reuses nothing (N = 1), and equal N everywhere is the plain field."""
    search = space(
        csa_ratio=[2],
        csa_window=[256],
        csa_topk=[48],
        csa_topk_share=[0, 1],
        csa_select_every=[1, 4],
        csa_summary=["none"],
        block_size=[16],
        chunk_size=[256],
    )
    assert {f"csa_select_every_s{i}" for i in range(3)} <= set(search.distributions())
    assert "csa_select_every" not in search.distributions()
    shares = {f"csa_topk_share_s{i}": share for i, share in enumerate((1, 1, 0))}
    banded = search.policy({**shares, "csa_select_every_s0": 4, "csa_select_every_s1": 1})
    by_layer = [0] * ARCH.num_layers
    for layer in GROUPS[0]:
        by_layer[layer] = 4
    for layer in (*GROUPS[1], *GROUPS[2]):
        by_layer[layer] = 1
    assert banded.layer_csa_select_every == tuple(by_layer)
    assert banded.csa_select_every == 4
    assert banded.layer_select_every(ARCH.num_layers) == by_layer
    # The group without selection drew 4 and still reuses nothing.
    idle = search.policy({**shares, "csa_select_every_s2": 4})
    assert idle.csa_select_every == 1 and idle.layer_csa_select_every is None
    full = {f"csa_topk_share_s{i}": 1 for i in range(3)}
    everywhere = search.policy({**full, **{f"csa_select_every_s{i}": 4 for i in range(3)}})
    assert everywhere.csa_select_every == 4 and everywhere.layer_csa_select_every is None
    draws = valid_draws(search, 60, seed=5)
    assert any(p.layer_csa_select_every is not None for p in draws)
    for drawn in draws:
        budgets = drawn.layer_topk(ARCH.num_layers)
        for budget, every in zip(budgets, drawn.layer_select_every(ARCH.num_layers), strict=True):
            assert every in {1, 4} and (budget or every == 1)


def test_layers_are_grouped_by_ascending_sensitivity():
    scores = [0.5, 0.01, 0.3, 0.02, 0.9, 0.04]
    assert group_layers(scores, 3) == ((1, 3), (2, 5), (0, 4))
    assert group_layers(scores, 1) == ((0, 1, 2, 3, 4, 5),)


def test_channel_keys_are_drawn_only_without_compression():
    """Per-channel key scales need whole blocks (KVPolicy's rule): a compressed draw falls back
    to token scales, so a space may list both axes beside compression."""
    search = space(k_scale_axis=["token", "channel"], k_dtype=["fp8", "fp4"])
    assert search.distributions()["k_scale_axis"].choices == ("token", "channel")
    draws = valid_draws(search, 150, seed=2)
    assert all(p.k_scale_axis == "token" for p in draws if p.compressed)
    assert {p.k_scale_axis for p in draws if not p.compressed} == {"token", "channel"}


def test_channel_keys_sit_beside_selection_only_with_a_separate_bounds_index():
    """Beside compression, per-channel keys are kept exactly where KVPolicy allows them: no
    summaries, selection by key bounds, bounds in their own index; the index dtype is drawn
    only where key-bounds selection uses it (else auto)."""
    search = space(
        k_scale_axis=["token", "channel"],
        k_dtype=["fp8", "int4"],
        csa_summary=["pre_rope", "none"],
        csa_topk=[0, 4],
        csa_index_dtype=["auto", "int4", "fp8"],
    )
    draws = valid_draws(search, 300, seed=5)
    channel = [p for p in draws if p.compressed and p.k_scale_axis == "channel"]
    assert channel and all(p.csa_summary == "none" and p.csa_index_dtype != "auto" for p in channel)
    quest = [p for p in draws if p.selects and p.csa_summary == "none"]
    assert {p.csa_index_dtype for p in quest} == {"auto", "int4", "fp8"}
    assert all(p.csa_index_dtype == "auto" for p in draws if not p.selects)


def test_integer_draws_take_fp16_scales_and_a_group():
    """Integer formats keep zero points in fp16 group scales: beside E4M3 and per-tensor
    candidates, a draw with an integer stream takes fp16 scales and, where its integer codes
    use groups, the smallest group size; draws without one keep what they drew."""
    search = space(k_dtype=["fp8", "int4"], v_dtype=["fp4", "int3"], group_size=["tensor", 32, 16])
    draws = valid_draws(search, 300, seed=3)
    integer = [
        p for p in draws if {"int4", "int3"} & {d for pair in p.layer_pairs(6) for d in pair}
    ]
    assert integer and all(p.scale_dtype == "fp16" for p in integer)
    grouped = [p for p in integer if any(v == "int3" for _, v in p.layer_pairs(6))]
    assert grouped and all(p.group_size in (16, 32) for p in grouped)
    assert any(p.group_size == 16 for p in grouped)  # a per-tensor draw fell back to 16
    others = [p for p in draws if p not in integer]
    assert any(p.scale_dtype == "e4m3" for p in others)


def test_canonical_drops_a_key_scale_axis_that_no_key_uses():
    fp16_keys = KVPolicy(k_dtype="fp16", v_dtype="fp8", k_scale_axis="channel")
    assert canonical(fp16_keys).k_scale_axis == "token"
    no_values = KVPolicy(k_dtype="fp4", v_dtype="fp16", k_scale_axis="channel", group_size=16)
    assert canonical(no_values) == canonical(no_values.replace(group_size=32))
    both = KVPolicy(k_dtype="fp4", v_dtype="fp4", k_scale_axis="channel", group_size=16)
    assert canonical(both).k_scale_axis == "channel" and canonical(both).group_size == 16


def test_selection_draws_pair_topk_with_the_host_tier():
    """csa_topk > 0 always comes with csa_host (selected blocks live there) and with
    compression; without compression the selection knobs fall back to their defaults."""
    search = space(
        csa_ratio=[1, 2],
        csa_window=[256],
        csa_topk=[0, 48],
        csa_summary=["pre_rope", "none"],
        block_size=[16],
        chunk_size=[256],
    )
    policy = search.policy({"csa_ratio": 2, "csa_topk": 48, "csa_summary": "none"})
    assert policy.csa_host and policy.csa_index == "bounds" and policy.csa_summary == "none"
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    for _ in range(40):
        drawn = search.suggest(study.ask())
        assert drawn.csa_host == drawn.selects == (drawn.csa_topk > 0)
        if not drawn.compressed:
            assert (drawn.csa_topk, drawn.csa_index, drawn.csa_summary) == (0, "bounds", "pre_rope")


@pytest.mark.parametrize(
    ("knob", "candidates"),
    [("csa_staging", ["resident", "streamed"]), ("csa_select_every", [1, 4])],
)
def test_selection_knobs_are_drawn_only_with_selection(knob, candidates):
    """csa_staging and csa_select_every keep their first value (resident, 1) wherever nothing
    is selected (KVPolicy's rules), and every candidate is drawn with selection (in some
    layer: csa_select_every is drawn per layer group)."""
    search = space(
        csa_ratio=[1, 2],
        csa_window=[256],
        csa_topk=[0, 16],
        block_size=[16],
        chunk_size=[256],
        **{knob: candidates},
    )
    seen = set()
    for drawn in valid_draws(search, 60, seed=4):
        if not drawn.selects:
            assert getattr(drawn, knob) == candidates[0]
        elif knob == "csa_select_every":
            seen.update(drawn.layer_select_every(ARCH.num_layers))
        else:
            seen.add(getattr(drawn, knob))
    assert seen == set(candidates)


def test_kept_blocks_are_drawn_only_where_the_policy_rules_allow_them():
    """csa_keep survives a draw only with compression, no selection, a window of at least 7
    blocks and a recent region inside window - 7 blocks (KVPolicy's rules); elsewhere it is 0,
    and both cases occur."""
    search = space(
        csa_ratio=[1, 4],
        csa_window=[128, 512],
        csa_topk=[0, 8],
        csa_keep=[0, 0.25, 0.5],
        recent_unquantized=[0, 256],
        block_size=[16, 32],
        chunk_size=[512],
    )
    kept = 0
    for drawn in valid_draws(search, 200, seed=3):
        span = 7 * drawn.block_size
        allowed = (
            drawn.compressed
            and drawn.csa_topk == 0
            and drawn.csa_window >= span
            and drawn.recent_unquantized <= drawn.csa_window - span
        )
        if not allowed:
            assert drawn.csa_keep == 0.0, drawn
        kept += drawn.csa_keep > 0
    assert 0 < kept < 200


def test_summaries_are_dropped_only_under_selection_on_an_index_pool():
    """csa_summary none survives a draw only with csa_topk > 0 and the bounds or means index
    (KVPolicy's rule); elsewhere it falls back to pre_rope. Without summaries the pooling ratio
    means nothing, so every ratio draws one canonical policy (ratio 2)."""
    search = space(
        csa_ratio=[1, 4, 16],
        csa_window=[256],
        csa_topk=[0, 32],
        csa_index=["bounds", "means", "summaries"],
        csa_summary=["pre_rope", "none"],
        block_size=[16],
        chunk_size=[512],
    )
    skipped = []
    for drawn in valid_draws(search, 120, seed=5):
        if drawn.csa_summary == "none":
            assert drawn.csa_topk > 0 and drawn.csa_index in ("bounds", "means"), drawn
            assert drawn.csa_ratio == 2
            skipped.append(drawn.csa_index)
    assert 0 < len(skipped) < 120 and set(skipped) == {"bounds", "means"}


def test_keep_candidates_must_be_eighths_below_one():
    with pytest.raises(ConfigError) as error:
        space(csa_keep=[0, 0.3])
    assert error.value.field == "search.csa_keep"


def test_grouped_formats_without_zero_points_draw_a_group_too():
    """fp4_4over6 chooses a scale per group, so it has no per-tensor form though it keeps no
    zero point: a per-tensor draw with it takes the smallest group size candidate, a draw
    without it keeps per-tensor scales, and a space with no group size for it is refused."""
    search = space(k_dtype=["fp8", "fp4_4over6"], v_dtype=["fp8"], group_size=["tensor", 32, 16])
    fallen = search.policy({"group_size": "tensor", "k_dtype_g1": "fp4_4over6"})
    assert fallen.layer_pairs(6)[2:4] == [("fp4_4over6", "fp8")] * 2 and fallen.group_size == 16
    assert search.policy({"group_size": "tensor", "k_dtype_g1": "fp8"}).group_size == "tensor"
    draws = valid_draws(search, 100, seed=6)
    assert any("fp4_4over6" in {k for k, _ in p.layer_pairs(6)} for p in draws)
    with pytest.raises(ConfigError) as error:
        space(k_dtype=["fp8", "fp4_4over6"], group_size=["tensor"])
    assert error.value.field == "search.k_dtype" and "fp4_4over6" in str(error.value)


def test_rotation_candidates_need_a_power_of_two_head_dim_only_where_the_rotation_does():
    """hadamard and turboquant build one Sylvester matrix of head_dim rows; vLLM's transform
    (vllm_rht) works in blocks of head_dim's largest power-of-two divisor, so a 96-dim model
    may draw it."""
    odd = ModelArch("odd", 6, 8, 2, 96, 1 << 30, 8192)
    knobs = {**SEARCH, "k_dtype": ["fp8", "int4"], "group_size": [16, 32]}
    config = SearchConfig.from_dict({**knobs, "rotation": ["none", "vllm_rht"]}, odd)
    search = SearchSpace(config, GROUPS, odd.num_layers)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    rotations = set()
    for _ in range(60):
        trial = study.ask()
        policy = search.suggest(trial)
        policy.check_model(odd)
        rotations.add(policy.rotation)
        study.tell(trial, 0.0)
    assert rotations == {"none", "vllm_rht"}
    for rotation in ("hadamard", "turboquant"):
        with pytest.raises(ConfigError, match="search.rotation"):
            SearchConfig.from_dict({**knobs, "rotation": ["none", rotation]}, odd)
