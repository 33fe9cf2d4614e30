"""Every policy the tuner can meet passes every stage of the main job (issue 38, item 2).

The policies (tests/autotune/policy_sources.py): 200 seeded draws and every warm start of each
space in conf/search/, every preset in conf/policy/, and one policy per registered element
format on K and on V. Each goes, as a test of its own per stage so that a failure names the
policy and the stage, through: validation on SmolLM2-135M (30 layers, 3 KV heads, head_dim 64),
the planner's bytes and capacity plan, a trial record in an Optuna study on SQLite, an MLflow
trial run, a trials.csv row, the front table's label, and the export (kvtune.yaml, vllm.yaml,
sglang.args, llama-server.args, NOTES.md), whose kvtune.yaml reloads equal to the policy.
Whole-study stages (the CSV of all trials, the plots, the front table, MLflow's closing
artifacts) run once a study.

Nothing is measured: a trial stores made-up metrics (`fake_metrics`) the way a measured trial
stores them, and the recipe is the one `kvtune tune search=<space>` composes with Hydra. Each
space's layer groups are contiguous runs of layers instead of the sensitivity profile's, which
needs a model run; the draws do not depend on the profile. `build_setup` resolves the embedded
model, which converts its GGUF file into the kvtune cache on first use (about 10 s, once per
cache); no weights are loaded into a model and nothing is evaluated.

The stages' functions are called directly, never through `kvtune tune`'s loop, so that no
tolerance of bookkeeping errors there can hide a format a table is missing.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import io
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.image
import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from kvtune.autotune.cli.report import policy_label, render_front
from kvtune.autotune.export.engines import write_export
from kvtune.autotune.planning.capacity import build_plan
from kvtune.autotune.study.objectives import METRICS, capacity_metrics
from kvtune.autotune.study.optuna_study import (
    DUPLICATE_ATTR,
    POLICY_ATTR,
    STARTED_ATTR,
    WARM_START_ATTR,
    StudySettings,
    create_or_resume,
    load_recipe,
    open_storage,
    policy_key,
)
from kvtune.autotune.study.recipe import TuneSetup, build_setup, recipe_from_config
from kvtune.autotune.study.results import (
    TrialRecord,
    pareto_front,
    pick_trial,
    policy_columns,
    trial_records,
    write_trials_csv,
)
from kvtune.autotune.tracking.mlflow_tracker import StudyTracker
from kvtune.autotune.tracking.plots import pareto_html, pareto_png
from kvtune.autotune.tracking.result_files import StudyResults, write_result_files
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.scale_formats import SCALE_FORMATS
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence, kv_bytes_per_token
from kvtune.runtime.policy import PER_TENSOR, KVPolicy
from tests.autotune.policy_sources import (
    ARCH,
    CONF,
    DRAWS_PER_SPACE,
    FORMATS_GROUP,
    PRESETS_GROUP,
    PolicySource,
    all_sources,
    format_dtypes,
    format_fields,
    format_sources,
    search_space,
    space_names,
)

SOURCES = all_sources()
GROUPS = list(dict.fromkeys(source.group for source in SOURCES))
LAYERS = ARCH.num_layers
MIB = 1 << 20
TRIAL_SECONDS = 1.5
FRONT_SIZE = 4
EXPORT_FILES = ["kvtune.yaml", "vllm.yaml", "sglang.args", "llama-server.args", "NOTES.md"]
# llama.cpp pads a slot's context to a multiple of this (src/llama-context.cpp).
LLAMACPP_CONTEXT_PAD = 256
# DESIGN.md section 1: bytes an element of an unquantized dtype takes (auto: the model's dtype).
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

each_source = pytest.mark.parametrize("source", SOURCES, ids=[source.id for source in SOURCES])
each_group = pytest.mark.parametrize("group", GROUPS)


# What the tests expect, written from DESIGN.md and the configs rather than from the code.


def expected_pairs(policy: KVPolicy) -> list[tuple[str, str]]:
    """Each layer's (K, V) dtypes: layer_dtypes, else k_dtype / v_dtype everywhere; the first
    and last boundary_layers (at most half the model each) in fp16."""
    listed = [tuple(pair.split("/")) for pair in policy.layer_dtypes or ()]
    pairs = listed or [(policy.k_dtype, policy.v_dtype)] * LAYERS
    edge = min(policy.boundary_layers, LAYERS // 2)
    return [("fp16", "fp16") if i < edge or i >= LAYERS - edge else p for i, p in enumerate(pairs)]


def plain(policy: KVPolicy) -> bool:
    """Whether DESIGN.md section 1's formula alone gives the policy's bytes: every token cached
    once in the layer's formats (no compression, no fp16 recent tokens, keys scaled per token)."""
    return (
        not policy.compressed and not policy.recent_unquantized and policy.k_scale_axis == "token"
    )


def vector_bytes(dtype: str, group: int | str, scale_dtype: str) -> float:
    """Bytes one cached vector of head_dim D takes (DESIGN.md section 1): 16-bit dtypes 2 bytes
    an element; a quantized one D * bits / 8 bytes of codes plus D / g group scales in the scale
    dtype, and as many zero points for an asymmetric format (none per tensor)."""
    size = ARCH.cached_vector_size
    if dtype == "auto" or dtype in ELEMENT_BYTES:
        return size * ELEMENT_BYTES[ARCH.dtype if dtype == "auto" else dtype]
    element = ELEMENT_FORMATS[dtype]
    codes = size * element.bits / 8
    if group == PER_TENSOR:
        return codes
    words = 2 if element.zero_point else 1
    return codes + size // group * words * SCALE_FORMATS[scale_dtype].nbytes


def design_bytes(policy: KVPolicy, tokens: int) -> int:
    """KV bytes of one sequence of a plain policy: per layer, H_kv heads x (K + V vector bytes)
    for every token, the sequence rounded up to whole blocks."""
    paged = math.ceil(tokens / policy.block_size) * policy.block_size
    key_group = policy.group_size if policy.k_group_size is None else policy.k_group_size
    per_token = sum(
        vector_bytes(k, key_group, policy.scale_dtype)
        + vector_bytes(v, policy.group_size, policy.scale_dtype)
        for k, v in expected_pairs(policy)
    )
    total = ARCH.num_kv_heads * per_token * paged
    assert total == int(total)
    return int(total)


@functools.cache
def engine_dtypes(engine: str) -> set[str]:
    """The --kv-cache-dtype values conf/policy/<engine>/*.yaml name on their first line
    ("--kv-cache-dtype fp8 (= fp8_e4m3)"), each preset's own name, and auto (the model's
    dtype, DESIGN.md section 5)."""
    pattern = re.compile(r"--kv-cache-dtype (\w+)(?: \(= (\w+)\))?")
    names = {"auto"}
    for path in (CONF / "policy" / engine).glob("*.yaml"):
        match = pattern.search(path.read_text().splitlines()[0])
        assert match, f"{path} names no --kv-cache-dtype on its first line"
        names |= {path.stem, *(value for value in match.groups() if value)}
    return names


def llamacpp_types() -> dict[str, bool]:
    """The cache types conf/policy/llamacpp/*.yaml name on their first line ("--cache-type-k
    q4_0 --cache-type-v q4_0"), each with whether it is quantized (a q or iq type, DESIGN.md
    section 8's list)."""
    pattern = re.compile(r"--cache-type-k (\w+) --cache-type-v (\w+)")
    names = set()
    for path in (CONF / "policy" / "llamacpp").glob("*.yaml"):
        match = pattern.search(path.read_text().splitlines()[0])
        assert match, f"{path} names no --cache-type-k on its first line"
        names |= {path.stem, *match.groups()}
    return {name: name.startswith(("q", "iq")) for name in names}


def fake_metrics(index: int, count: int) -> dict[str, float]:
    """Made-up measurements of the index-th of count trials, one of each metric a trial reports:
    retention falls with the index (all feasible: >= 0.95), KV bytes fall over the first
    FRONT_SIZE trials and rise after, so those trials, and only they, form the Pareto front."""
    kv_mib = count - index if index < FRONT_SIZE else count + index
    return {
        **dict.fromkeys(METRICS, 1.0),
        "accuracy_retention": 1.0 - 0.05 * index / count,
        "kv_bytes_per_sequence": float(kv_mib * MIB),
    }


def check_flattened(columns: Mapping[str, str], policy: KVPolicy, none: str) -> None:
    """A policy flattened to text (a CSV row, MLflow params; `none` is how None reads there):
    every field but the per-layer lists as it is, one token a layer in `layers` (equal tokens
    for equal K/V pairs), and for K and for V each dtype's count of layers."""
    for name, value in policy.to_dict().items():
        if not name.startswith("layer_"):
            assert columns[name] == (none if value is None else str(value)), name
    pairs = expected_pairs(policy)
    tokens = columns["layers"].split()
    assert len(tokens) == LAYERS
    assert len(set(zip(tokens, pairs, strict=True))) == len(set(tokens)) == len(set(pairs))
    for side, index in (("k", 0), ("v", 1)):
        for dtype in format_dtypes():
            count = sum(pair[index] == dtype for pair in pairs)
            expected = str(count) if count else none
            assert columns.get(f"{side}_{dtype}_layers", none) == expected, (side, dtype)


def hover_trials(html: str) -> list[int]:
    """Trial numbers of the hover texts ("trial 3<br>...") in a plotly HTML file: the data
    of its Plotly.newPlot call, read as JSON."""
    start = html.index("[", html.index("Plotly.newPlot("))
    data, _ = json.JSONDecoder().raw_decode(html, start)
    texts = [text for trace in data for text in trace["text"]]
    return [int(text.split("<br>")[0].removeprefix("trial ")) for text in texts]


# The study of each group of sources, as `kvtune tune` stores it and `kvtune export` reads it.


@functools.cache
def tune_recipe(search: str) -> dict[str, Any]:
    """The recipe `kvtune tune search=<search>` stores (Hydra composes conf/tune.yaml)."""
    overrides = [f"search={search}"]
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("tune", overrides=overrides)
    recipe = recipe_from_config(cfg, overrides)
    assert ModelArch(**recipe["arch"]) == ARCH
    return recipe


@functools.cache
def tune_setup(search: str) -> TuneSetup:
    return build_setup(tune_recipe(search))


def measured_trial(
    source: PolicySource, policy: KVPolicy, metrics: dict[str, float], setup: TuneSetup
) -> FrozenTrial:
    """The trial a measured policy leaves in the study (TrialObjective.__call__): its origin,
    policy and metrics, the objectives as values, the constraints. A drawn trial's Optuna params
    are left out: each param costs the storage an ORM round trip (the draws' would add about
    half a minute) and no stage after sampling reads them."""
    return optuna.trial.create_trial(
        state=TrialState.COMPLETE,
        values=[metrics[name] for name in setup.objectives],
        user_attrs={
            **source.user_attrs,
            STARTED_ATTR: True,
            POLICY_ATTR: policy.to_dict(),
            "metrics": metrics,
            "cached": False,
            "seconds": TRIAL_SECONDS,
        },
        constraints=setup.constraints.values(metrics),
    )


def duplicate_trial(source: PolicySource, policy: KVPolicy, original: int) -> FrozenTrial:
    """The trial of a policy the study has measured already: pruned, naming the trial that
    measured it (TrialObjective.__call__; vLLM's and SGLang's fp8 and nvfp4 are one policy)."""
    return optuna.trial.create_trial(
        state=TrialState.PRUNED,
        user_attrs={
            **source.user_attrs,
            STARTED_ATTR: True,
            POLICY_ATTR: policy.to_dict(),
            DUPLICATE_ATTR: original,
        },
    )


@dataclass(frozen=True)
class GroupStudy:
    """One group's study on SQLite and its MLflow experiment.

    setup: rebuilt from the recipe stored in the study, as `kvtune export` rebuilds it.
    numbers: each source's own trial; measured: the trial that measured each source's policy
        (its own, or an earlier source's of the same policy); metrics: by measuring trial.
    trials, records: the study's trials and trial_records, read back from the storage.
    """

    settings: StudySettings
    setup: TuneSetup
    study: optuna.Study
    numbers: dict[str, int]
    measured: dict[str, int]
    metrics: dict[int, dict[str, float]]
    trials: dict[int, FrozenTrial]
    records: dict[int, TrialRecord]
    tracker: StudyTracker


def record_group(group: str, folder: Path, tracking_uri: str) -> GroupStudy:
    """Store a trial for every source of the group that builds (one that does not fails its own
    validation test), then read the study back as `kvtune export` does."""
    sources = [source for source in SOURCES if source.group == group]
    recipe = tune_recipe(sources[0].search)
    setup = tune_setup(sources[0].search)
    settings = StudySettings(name=group, storage=f"sqlite:///{folder / 'optuna.db'}")
    study = create_or_resume(settings, open_storage(settings), recipe, setup.objectives)
    built = []
    for source in sources:
        try:
            built.append((source, source.build()))
        except ConfigError:
            continue
    distinct = len({policy_key(policy) for _, policy in built})
    numbers, measured, metrics, trials = {}, {}, {}, []
    first: dict[str, int] = {}  # policy key -> the trial that measured it
    for number, (source, policy) in enumerate(built):
        key = policy_key(policy)
        numbers[source.id] = number
        measured[source.id] = first.setdefault(key, number)
        if measured[source.id] != number:
            trials.append(duplicate_trial(source, policy, measured[source.id]))
            continue
        metrics[number] = fake_metrics(len(metrics), distinct)
        trials.append(measured_trial(source, policy, metrics[number], setup))
    study.add_trials(trials)
    stored, stored_recipe = load_recipe(
        settings, open_storage(settings, existing=True, runs_trials=False)
    )
    tracker = StudyTracker(
        tracking_uri,
        folder / "mlartifacts",
        group,
        "tune",
        {"model": setup.model, "workload": setup.workload.name, "metrics": "made up"},
        LAYERS,
    )
    return GroupStudy(
        settings=settings,
        setup=build_setup(stored_recipe),
        study=stored,
        numbers=numbers,
        measured=measured,
        metrics=metrics,
        trials={trial.number: trial for trial in stored.get_trials()},
        records={record.number: record for record in trial_records(stored)},
        tracker=tracker,
    )


class GroupStudies:
    """Each group's study, recorded when a test first asks for it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tracking_uri = f"sqlite:///{folder / 'mlflow.db'}"
        self.studies: dict[str, GroupStudy] = {}

    def __getitem__(self, group: str) -> GroupStudy:
        if group not in self.studies:
            folder = self.folder / group
            folder.mkdir()
            self.studies[group] = record_group(group, folder, self.tracking_uri)
        return self.studies[group]


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> GroupStudies:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        yield GroupStudies(tmp_path_factory.mktemp("every-draw"))


def measured(studies: GroupStudies, source: PolicySource) -> tuple[GroupStudy, TrialRecord]:
    """The source's study and the record of the trial that measured its policy."""
    group = studies[source.group]
    return group, group.records[group.measured[source.id]]


# Where the policies come from.


def test_sources_are_every_draw_warm_start_preset_and_format():
    assert len({source.id for source in SOURCES}) == len(SOURCES)
    for name in space_names():
        drawn = [s for s in SOURCES if s.id.startswith(f"space-{name}/draw-")]
        warm = [s.id for s in SOURCES if s.id.startswith(f"space-{name}/warm-")]
        assert len(drawn) == DRAWS_PER_SPACE
        assert warm == [f"space-{name}/warm-{start}" for start in search_space(name).warm_starts()]
    presets = {s.id.removeprefix(f"{PRESETS_GROUP}/") for s in SOURCES if s.group == PRESETS_GROUP}
    stems = {f"{p.parent.name}/{p.stem}" for p in (CONF / "policy").glob("*/*.yaml")}
    assert presets == stems | {"default"}
    covered = {s.id.removeprefix(f"{FORMATS_GROUP}/") for s in SOURCES if s.group == FORMATS_GROUP}
    expected = {f"{stream}={dtype}" for dtype in format_dtypes() for stream in "KV"}
    assert covered == expected - {"V=fp16"}  # the default policy: K=fp16 already
    choices = {name for name, element in ELEMENT_FORMATS.items() if element.cache_choice}
    assert choices <= set(format_dtypes())


def test_a_format_added_to_the_registry_reaches_the_pipeline(monkeypatch):
    """The format sources are read from the registry when listed, so a format added there gets
    a K and a V policy, built from its record (here whole vectors with fp32 scale words: group
    head_dim, scale_dtype fp32), and the first stage takes it up: the policy accepts it, or
    refuses it by name (the test of every such unwired format fails)."""
    throwaway = dataclasses.replace(ELEMENT_FORMATS["lloyd4"], scale_dtype="fp32")
    monkeypatch.setitem(ELEMENT_FORMATS, "throwaway", throwaway)
    sources = {source.id: source for source in format_sources()}
    assert {"formats/K=throwaway", "formats/V=throwaway"} <= set(sources)
    size = ARCH.cached_vector_size
    fields = {"v_dtype": "throwaway", "group_size": size, "scale_dtype": "fp32"}
    assert format_fields("throwaway", "V") == fields
    try:
        policy = sources["formats/V=throwaway"].build()
    except ConfigError as refused:
        assert (refused.field, refused.value) == ("policy.v_dtype", "throwaway")
    else:
        assert expected_pairs(policy) == [("fp16", "throwaway")] * LAYERS


# Stages of one policy.


@each_source
def test_policy_is_valid_on_the_model(source):
    policy = source.build()
    policy.check_model(ARCH)
    assert KVPolicy.from_dict(policy.to_dict()) == policy
    assert policy.layer_pairs(LAYERS) == expected_pairs(policy)


@each_source
def test_planner_counts_the_policy_bytes(source):
    policy = source.build()
    setup = tune_setup(source.search)
    device, serve = setup.device, setup.serve
    per_sequence = kv_bytes_per_sequence(ARCH, policy, serve.max_model_len)
    assert per_sequence > 0
    if plain(policy):
        assert per_sequence == design_bytes(policy, serve.max_model_len)
        assert kv_bytes_per_sequence(ARCH, policy, 1000) == design_bytes(policy, 1000)
    plan = build_plan(ARCH, policy, device, serve)
    # DESIGN.md section 1: memory x utilization - weights - activation reserve.
    budget = device.memory_gib * GIB * serve.gpu_memory_utilization
    budget = int(budget - ARCH.weights_bytes - serve.activation_reserve_gib * GIB)
    assert plan.kv_budget_bytes == budget
    assert plan.chosen.kv_bytes_per_sequence == per_sequence
    # The engine's own reserve (step slack, the fp16 recent pool, prefill scratch) counts
    # against the budget; tests/runtime/test_pool_plan.py checks it against what the engine
    # allocates. Here: it is there for every policy, and capacity is the budget left after the
    # shared part over a sequence's bytes plus its own part.
    chosen = plan.chosen
    assert chosen.reserve_bytes_per_sequence > 0 and chosen.reserve_bytes_shared > 0
    fits = max(0, budget - chosen.reserve_bytes_shared)
    assert chosen.max_num_seqs == fits // (per_sequence + chosen.reserve_bytes_per_sequence)
    fp16 = {row.name: row for row in plan.compare}["fp16"]
    paged = math.ceil(serve.max_model_len / policy.block_size) * policy.block_size
    assert fp16.kv_bytes_per_sequence == LAYERS * ARCH.num_kv_heads * ARCH.head_dim * 2 * 2 * paged
    trial = capacity_metrics(ARCH, policy, device, serve, setup.workload)
    assert trial["kv_bytes_per_sequence"] == kv_bytes_per_sequence(
        ARCH, policy, setup.workload.context_len
    )
    # A trial's capacity is the planner's at the workload's context, reserve included.
    at_context = dataclasses.replace(serve, max_model_len=setup.workload.context_len)
    row = build_plan(ARCH, policy, device, at_context).chosen
    per_sequence_at_context = trial["kv_bytes_per_sequence"] + row.reserve_bytes_per_sequence
    fits = max(0, budget - row.reserve_bytes_shared)
    assert trial["max_num_seqs"] == fits // per_sequence_at_context


@each_source
def test_study_records_the_trial(source, studies):
    policy = source.build()
    group, record = measured(studies, source)
    trial = group.trials[group.numbers[source.id]]
    assert trial.user_attrs[POLICY_ATTR] == policy.to_dict()
    if record.number != trial.number:
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs[DUPLICATE_ATTR] == record.number
    assert record.policy == policy and record.complete and record.feasible
    assert record.metrics == group.metrics[record.number]
    assert record.failure_reason is None
    assert record.warm_start == group.trials[record.number].user_attrs.get(WARM_START_ATTR)
    records = list(group.records.values())
    assert pick_trial(records, group.setup.objectives, f"trial={record.number}") == record


@each_source
def test_mlflow_run_holds_the_policy_and_metrics(source, studies):
    """A source's own trial is logged; a duplicate's (pruned) leaves no run, and its policy's
    run is the measuring source's."""
    policy = source.build()
    group, record = measured(studies, source)
    tracker = group.tracker
    number = group.numbers[source.id]
    tracker.log_trial(group.study, group.trials[number])
    runs = tracker.client.search_runs(
        [tracker.experiment_id], filter_string=f"tags.trial_number = '{number}'"
    )
    if number != record.number:
        assert runs == []
        return
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["state"] == "COMPLETE"
    assert run.data.tags.get("warm_start") == source.user_attrs.get(WARM_START_ATTR)
    assert run.data.params == {k: str(v) for k, v in policy_columns(policy, LAYERS).items()}
    check_flattened(run.data.params, policy, none="None")
    expected = {**group.metrics[number], "cached": 0.0, "trial_seconds": TRIAL_SECONDS}
    assert run.data.metrics == expected


@each_source
def test_trials_csv_row_holds_the_policy(source, studies, tmp_path):
    policy = source.build()
    group, record = measured(studies, source)
    path = tmp_path / "trials.csv"
    write_trials_csv([record], [record.number], LAYERS, path)
    with path.open(newline="") as table:
        rows = list(csv.DictReader(table))
    assert len(rows) == 1 and rows[0]["trial"] == str(record.number)
    for name, value in record.metrics.items():
        assert float(rows[0][name]) == value
    check_flattened(rows[0], policy, none="")


@each_source
def test_front_table_labels_the_policy(source, studies):
    policy = source.build()
    _, record = measured(studies, source)
    label = f" {policy_label(record, LAYERS)} "
    for (k, v), count in collections.Counter(expected_pairs(policy)).items():
        assert f" {k}/{v} x{count} " in label
    assert f" b{policy.block_size} c{policy.chunk_size} " in label


@each_source
def test_export_writes_engine_configs_and_reloads(source, studies, tmp_path):
    policy = source.build()
    group, record = measured(studies, source)
    setup, name = group.setup, group.settings.name
    records = list(group.records.values())
    pick = f"trial={record.number}"
    assert pick_trial(records, setup.objectives, pick) == record
    paths = write_export(tmp_path, record, setup, setup.device, name, pick, records)
    assert [path.name for path in paths] == EXPORT_FILES
    kvtune_yaml = (tmp_path / "kvtune.yaml").read_text()
    assert kvtune_yaml.startswith("#")
    body = "".join(line for line in kvtune_yaml.splitlines(True) if not line.startswith("#"))
    assert KVPolicy.from_yaml(body) == policy
    vllm = yaml.safe_load((tmp_path / "vllm.yaml").read_text())
    assert vllm["kv-cache-dtype"] in engine_dtypes("vllm")
    skipped = {int(layer) for layer in vllm.get("kv-cache-dtype-skip-layers", [])}
    assert skipped <= set(range(LAYERS))
    assert vllm["block-size"] == policy.block_size
    assert vllm["max-model-len"] == setup.serve.max_model_len
    assert vllm["max-num-seqs"] >= 1
    # The engines' host pools are asked for where the host tier holds a block at the context.
    context = setup.serve.expected_context_len or setup.serve.max_model_len
    older = (context - policy.csa_sinks - policy.csa_window) // policy.block_size
    offloads = policy.csa_host and older > 0
    assert (vllm.get("kv-offloading-backend") == "native") == offloads
    assert (vllm.get("kv-offloading-size", 0) > 0) == offloads
    lines = (tmp_path / "sglang.args").read_text().splitlines()
    options = dict((*line.split(" ", 1), "")[:2] for line in lines)  # a flag has no value
    assert options["--kv-cache-dtype"] in engine_dtypes("sglang")
    assert options["--page-size"] == str(policy.block_size)
    assert options["--chunked-prefill-size"] == str(policy.chunk_size)
    assert ("--enable-hierarchical-cache" in options) == offloads
    assert int(options.get("--hicache-size", 0)) >= offloads
    lines = (tmp_path / "llama-server.args").read_text().splitlines()
    options = dict(line.split(" ", 1) for line in lines)
    types = llamacpp_types()
    quantized_v = types[options["--cache-type-v"]]
    assert options["--cache-type-k"] in types
    assert options.get("--flash-attn") == ("on" if quantized_v else None)
    slot = -(-context // LLAMACPP_CONTEXT_PAD) * LLAMACPP_CONTEXT_PAD
    assert int(options["--ctx-size"]) == int(options["--parallel"]) * slot
    notes = (tmp_path / "NOTES.md").read_text()
    assert f"(trial {record.number})" in notes.splitlines()[0]


# Stages of a whole study.


@each_group
def test_trials_csv_has_one_row_per_trial(group, studies, tmp_path):
    study = studies[group]
    records = list(study.records.values())
    front = [record.number for record in records[:FRONT_SIZE]]
    path = tmp_path / "trials.csv"
    write_trials_csv(records, front, LAYERS, path)
    with path.open(newline="") as table:
        rows = list(csv.DictReader(table))
    assert [int(row["trial"]) for row in rows] == sorted(study.metrics)
    legend: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
    for row, record in zip(rows, records, strict=True):
        assert row["state"] == "COMPLETE" and row["pareto"] == str(record.number in front)
        check_flattened(row, record.policy, none="")
        for token, pair in zip(row["layers"].split(), expected_pairs(record.policy), strict=True):
            legend[token].add(pair)
    # One token stands for one K/V pair in the whole table, so a legend decodes every row.
    assert all(len(pairs) == 1 for pairs in legend.values())
    assert len({pair for pairs in legend.values() for pair in pairs}) == len(legend)


@each_group
def test_plots_show_every_trial(group, studies, tmp_path):
    study = studies[group]
    records = list(study.records.values())
    front = [record.number for record in pareto_front(records, study.setup.objectives)]
    assert front == sorted(study.metrics)[:FRONT_SIZE]  # as fake_metrics made them
    pareto_png(records, front, study.setup.objectives, tmp_path / "front.png")
    image = matplotlib.image.imread(tmp_path / "front.png")
    assert image.ndim == 3 and min(image.shape[:2]) > 100
    pareto_html(records, front, study.setup.objectives, LAYERS, tmp_path / "front.html")
    assert sorted(hover_trials((tmp_path / "front.html").read_text())) == sorted(study.metrics)


@each_group
def test_front_table_lists_every_trial(group, studies):
    """Every trial given as the front, so that every policy's label is rendered."""
    study = studies[group]
    records = list(study.records.values())
    front = [record.number for record in records]
    console = Console(file=io.StringIO(), width=2000, color_system=None)
    render_front(console, group, records, front, LAYERS)
    table = console.file.getvalue()
    count = len(records)
    assert f"Pareto front of study {group}: {count} of {count} complete trials (0 failed)" in table
    for record in records:
        assert f" {policy_label(record, LAYERS)} " in table


@each_group
def test_mlflow_finish_attaches_the_study(group, studies, tmp_path):
    study = studies[group]
    tracker = study.tracker
    records = list(study.records.values())
    front = [record.number for record in pareto_front(records, study.setup.objectives)]
    recipe = yaml.safe_dump(study.setup.recipe, sort_keys=False)
    results = StudyResults(records, front, study.setup.objectives, LAYERS, recipe)
    folder = tmp_path / "study"
    written = write_result_files(folder, results)  # raises: here an error is fatal
    tracker.refresh_trial_tags(front, {})
    tracker.log_result_files(folder, written)
    tracker.finish(front, {})
    parent = tracker.client.get_run(tracker.parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["pareto_trials"] == ",".join(map(str, front))
    listed = {artifact.path for artifact in tracker.client.list_artifacts(tracker.parent_id)}
    assert {"trials.csv", "recipe.yaml", "pareto_front.png", "pareto_front.html"} <= listed
    kept = {artifact.path for artifact in tracker.client.list_artifacts(tracker.parent_id, "front")}
    assert kept == {f"front/trial_{number}.kvtune.yaml" for number in front}
    table = Path(tracker.client.download_artifacts(tracker.parent_id, "trials.csv", tmp_path))
    with table.open(newline="") as rows:
        assert [int(row["trial"]) for row in csv.DictReader(rows)] == sorted(study.metrics)
    for run in tracker.trial_runs():  # those the tests above logged
        assert run.data.tags["pareto"] == str(int(run.data.tags["trial_number"]) in front).lower()


# The planner's bytes against numbers worked out by hand.


def test_planner_bytes_match_hand_computed_sequences():
    """SmolLM2 (30 layers, 3 KV heads, head_dim 64), 1,000 tokens in 16-token blocks = 1,008
    cached tokens; per token and layer 3 heads x (K + V)."""
    cases = {
        # 2 bytes an element: 3 x 2 x 64 x 2 = 768 B a layer.
        KVPolicy(): 30 * 768 * 1008,
        # E4M3 per tensor: 1 byte an element, no scale bytes.
        KVPolicy("fp8", "fp8", group_size="tensor"): 30 * 384 * 1008,
        # E2M1 in groups of 16 with E4M3 scales: 32 B of codes + 4 scales of 1 B.
        KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"): 30 * 3 * 2 * 36 * 1008,
        # int4 in groups of 32, fp16 scale and zero point: 32 B + 2 x (2 + 2) B.
        KVPolicy("int4", "int4", group_size=32): 30 * 3 * 2 * 40 * 1008,
        # int3: 24 B of codes + 2 x (2 + 2) B.
        KVPolicy("int3", "int3", group_size=32): 30 * 3 * 2 * 32 * 1008,
    }
    for policy, expected in cases.items():
        assert kv_bytes_per_sequence(ARCH, policy, 1000) == expected == design_bytes(policy, 1000)
    # DESIGN.md's example: 61 layers, 8 KV heads, head_dim 128, fp16: 249,856 bytes a token.
    large = ModelArch("design-example", 61, 64, 8, 128, 0, 131072, "bf16")
    assert kv_bytes_per_token(large, KVPolicy()) == 249_856
