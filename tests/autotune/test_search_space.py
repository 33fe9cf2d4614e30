"""The search space: config validation, valid draws only, warm starts, canonical policies."""

import optuna
import pytest

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


def test_warm_starts_cover_the_standard_points():
    starts = space().warm_starts()
    assert list(starts) == ["baseline", "all-fp8", "fp4-shallow-fp8-deep", "k-fp8-v-fp4"]
    search = space()
    baseline = search.policy(starts["baseline"])
    assert baseline.layer_pairs(6) == [("fp16", "fp16")] * 6 and not baseline.compressed
    mixed = search.policy(starts["fp4-shallow-fp8-deep"]).layer_pairs(6)
    assert mixed[:2] == [("fp4", "fp4")] * 2 and mixed[4:] == [("fp8", "fp8")] * 2
    assert search.policy(starts["k-fp8-v-fp4"]).layer_pairs(6) == [("fp8", "fp4")] * 6


def test_warm_starts_the_space_cannot_express_are_left_out():
    starts = space(k_dtype=["fp16", "fp8"], v_dtype=["fp16", "fp8"]).warm_starts()
    assert list(starts) == ["baseline", "all-fp8"]


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
    assert {f"csa_topk_share_g{i}" for i in range(3)} <= set(search.distributions())
    assert "csa_topk_share" not in search.distributions()
    params = {"csa_topk_share_g0": 0.25, "csa_topk_share_g1": 0, "csa_topk_share_g2": 0.25}
    pyramid = search.policy(params)
    assert pyramid.layer_csa_topk == (12, 12, 0, 0, 12, 12) and pyramid.csa_topk == 12
    assert pyramid.csa_host and pyramid.csa_summary == "none"
    uniform = search.policy({f"csa_topk_share_g{i}": 1 for i in range(3)})
    assert uniform.layer_csa_topk is None and uniform.csa_topk == 48
    nothing = search.policy({f"csa_topk_share_g{i}": 0 for i in range(3)})
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
    assert {f"csa_select_every_g{i}" for i in range(3)} <= set(search.distributions())
    assert "csa_select_every" not in search.distributions()
    shares = {f"csa_topk_share_g{i}": share for i, share in enumerate((1, 1, 0))}
    banded = search.policy({**shares, "csa_select_every_g0": 4, "csa_select_every_g1": 1})
    by_layer = [0] * ARCH.num_layers
    for layer in GROUPS[0]:
        by_layer[layer] = 4
    for layer in (*GROUPS[1], *GROUPS[2]):
        by_layer[layer] = 1
    assert banded.layer_csa_select_every == tuple(by_layer)
    assert banded.csa_select_every == 4
    assert banded.layer_select_every(ARCH.num_layers) == by_layer
    # The group without selection drew 4 and still reuses nothing.
    idle = search.policy({**shares, "csa_select_every_g2": 4})
    assert idle.csa_select_every == 1 and idle.layer_csa_select_every is None
    full = {f"csa_topk_share_g{i}": 1 for i in range(3)}
    everywhere = search.policy({**full, **{f"csa_select_every_g{i}": 4 for i in range(3)}})
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


def test_the_int4_start_needs_every_knob_it_sets():
    knobs = dict(
        k_dtype=["fp16", "fp8", "int4"],
        v_dtype=["fp16", "fp8", "int4"],
        group_size=[32, 64],
        scale_dtype=["fp16"],
        k_scale_axis=["token", "channel"],
        rotation=["none", "hadamard"],
        csa_ratio=[1],
        block_size=[16, 32],
    )
    search = space(**knobs)
    policy = search.policy(search.warm_starts()["int4-k-channel-rotated"])
    expected = KVPolicy(
        "int4", "int4", group_size=64, k_scale_axis="channel", rotation="hadamard", block_size=32
    )
    assert policy == canonical(expected.replace(chunk_size=policy.chunk_size))
    assert "int4-k-channel-rotated" not in space(**{**knobs, "rotation": ["none"]}).warm_starts()


def test_selection_warm_start_and_draws_pair_topk_with_the_host_tier():
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
    policy = search.policy(search.warm_starts()["fp8-w256-top48-host-no-summaries"])
    assert (policy.csa_ratio, policy.csa_window, policy.csa_topk) == (2, 256, 48)
    assert policy.csa_host and policy.csa_index == "bounds" and policy.csa_summary == "none"
    assert policy.layer_pairs(6) == [("fp8", "fp8")] * 6
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(sampler=sampler)
    for _ in range(40):
        drawn = search.suggest(study.ask())
        assert drawn.csa_host == drawn.selects == (drawn.csa_topk > 0)
        if not drawn.compressed:
            assert (drawn.csa_topk, drawn.csa_index, drawn.csa_summary) == (0, "bounds", "pre_rope")
    assert "fp8-w256-top48-host-no-summaries" not in space().warm_starts()


def test_the_4bit_selection_start_pairs_channel_keys_with_a_separate_index():
    """The 4-bit host-tier start (0.18 of fp16's device bytes at 3K in
    benchmarks/compression.py) is expressible only where every knob it sets is a candidate."""
    knobs = dict(
        k_dtype=["fp16", "int4"],
        v_dtype=["fp16", "int4"],
        group_size=[32, 64],
        scale_dtype=["fp16"],
        k_scale_axis=["token", "channel"],
        rotation=["none", "hadamard"],
        csa_ratio=[1, 2],
        csa_window=[256],
        csa_topk=[0, 80],
        csa_summary=["pre_rope", "none"],
        csa_index_dtype=["auto", "int4"],
        block_size=[16],
        chunk_size=[256],
    )
    search = space(**knobs)
    policy = search.policy(search.warm_starts()["int4-k-channel-w256-top80-host-int4-index"])
    expected = KVPolicy(
        "int4",
        "int4",
        group_size=64,
        k_scale_axis="channel",
        rotation="hadamard",
        block_size=16,
        chunk_size=256,
        csa_ratio=2,
        csa_window=256,
        csa_topk=80,
        csa_host=True,
        csa_summary="none",
        csa_index_dtype="int4",
    )
    assert policy == canonical(expected.replace(csa_sinks=policy.csa_sinks))
    without_index = space(**{**knobs, "csa_index_dtype": ["auto"]}).warm_starts()
    assert "int4-k-channel-w256-top80-host-int4-index" not in without_index
    # Its streamed twin needs csa_staging among the candidates.
    assert "int4-k-channel-w256-top80-streamed-int4-index" not in search.warm_starts()
    streaming = space(**knobs, csa_staging=["resident", "streamed"])
    twin = streaming.warm_starts()["int4-k-channel-w256-top80-streamed-int4-index"]
    assert streaming.policy(twin) == policy.replace(csa_staging="streamed")


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
