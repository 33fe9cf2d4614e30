"""Every KV dtype the policy accepts flows through every consumer of the format registry.

The dtypes are listed from the registry (KV_DTYPES), so a new format is covered here without an
edit; a hand-written table that misses one (the main job's int3 crash: a KeyError in the trial
table's codes) fails here. The last test registers a throwaway format in a fresh interpreter and
shows the consumers pick it up with no other edit.
"""

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from kvtune.autotune.config.settings import DeviceSpec
from kvtune.autotune.export.engines import (
    _policy_gaps,
    layer_levels,
    sglang_mapping,
    vllm_mapping,
    write_export,
)
from kvtune.autotune.planning.capacity import build_plan
from kvtune.autotune.planning.report import render_plan
from kvtune.autotune.search.space import SearchConfig, SearchSpace
from kvtune.autotune.study.results import TrialRecord, policy_columns, write_trials_csv
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES
from kvtune.kernels.formats.scale_formats import SCALE_FORMATS
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import index_format, kv_bytes_per_token
from kvtune.runtime.kv_dtypes import AUTO, KV_DTYPE_INFO, KV_DTYPES, most_precise_first
from kvtune.runtime.policy import CSA_INDEX_DTYPES, GROUPED_DTYPES, INDEX_IN_LAYER_FORMAT, KVPolicy
from tests.autotune.test_export import SGLANG_KV_DTYPES, VLLM_KV_DTYPES, smollm_chat_setup

ROOT = Path(__file__).resolve().parents[2]
DEVICE = DeviceSpec("24g", 24, 1000)
ENGINE_STORAGE_CLASSES = {AUTO, "fp8", "fp4"}


def storage(dtype: str, head_dim: int, group: int = 16) -> dict:
    """Scale fields a policy storing `dtype` may use: the format's own scale dtype and, for
    codes of whole vectors, a group of head_dim."""
    element = ELEMENT_FORMATS.get(dtype)
    whole = element is not None and element.whole_vector
    scale = element.scale_dtype if element is not None and element.scale_dtype else "fp16"
    return {"group_size": head_dim if whole else group, "scale_dtype": scale}


def read_layer_codes(layers: str) -> list[tuple[str, str]]:
    """The trial table's per-layer column back to (K, V) pairs: each code pair split where its
    first code ends (the codes are prefix-free, so there is one place)."""
    by_code = {info.table_code: dtype for dtype, info in KV_DTYPE_INFO.items()}
    pairs = []
    for token in layers.split():
        [(k, v)] = [
            (by_code[token[:end]], by_code[token[end:]])
            for end in range(1, len(token))
            if token[:end] in by_code and token[end:] in by_code
        ]
        pairs.append((k, v))
    return pairs


def expected_bytes_per_token(dtype: str, policy: KVPolicy, arch) -> int:
    """KV bytes a token adds, from the format's documented layout: head_dim codes of `bits`
    bits, then one scale (and one zero point) per group, for K and V of every KV head and
    layer; the model's own dtype for auto."""
    name = arch.dtype if dtype == AUTO else dtype
    element = ELEMENT_FORMATS[name]
    vector = arch.head_dim * element.bits // 8
    if element.quantized:
        scale_bytes = SCALE_FORMATS[policy.scale_dtype].torch_dtype.itemsize
        per_group = 2 if element.zero_point else 1
        vector += arch.head_dim // policy.group_size * per_group * scale_bytes
    return arch.num_layers * arch.num_kv_heads * 2 * vector


def check_consumers(dtype: str, folder: Path) -> None:
    """dtype (a policy dtype) through validation, trial tables, the planner, the search space,
    warm starts and the export."""
    setup = smollm_chat_setup()
    arch, layers = setup.arch, setup.arch.num_layers
    fields = storage(dtype, arch.head_dim)
    quantized = dtype in QUANTIZED_DTYPES

    for k, v in ((dtype, AUTO), (AUTO, dtype), (dtype, dtype)):
        policy = KVPolicy(k_dtype=k, v_dtype=v, **fields)
        policy.check_model(arch)
        columns = policy_columns(policy, layers)
        assert read_layer_codes(columns["layers"]) == [(k, v)] * layers
        counts = {key: n for key, n in columns.items() if re.fullmatch(r"[kv]_\w+_layers", key)}
        assert counts == {f"k_{k}_layers": layers, f"v_{v}_layers": layers}

    policy = KVPolicy(dtype, dtype, **fields)
    assert kv_bytes_per_token(arch, policy) == expected_bytes_per_token(dtype, policy, arch)
    record = TrialRecord(0, "COMPLETE", policy, {"accuracy_retention": 0.9}, True, None, None)
    write_trials_csv([record], [0], layers, folder / "trials.csv")
    [row] = csv.DictReader(io.StringIO((folder / "trials.csv").read_text()))
    assert row[f"k_{dtype}_layers"] == row[f"v_{dtype}_layers"] == str(layers)

    levels = set(layer_levels(policy, layers))
    if quantized:
        assert len(levels) == 1 and levels < ENGINE_STORAGE_CLASSES and AUTO not in levels
    else:
        assert levels == {AUTO}
    vllm, sglang = vllm_mapping(policy, arch), sglang_mapping(policy, arch)
    assert vllm.kv_cache_dtype in VLLM_KV_DTYPES
    assert sglang.kv_cache_dtype in SGLANG_KV_DTYPES

    gaps = _policy_gaps(policy, arch, formats_exported=False)
    named = [gap for gap in gaps if gap.startswith(f"{dtype}: {KV_DTYPE_INFO[dtype].description}")]
    assert len(named) == (1 if quantized else 0), gaps
    if quantized and dtype not in GROUPED_DTYPES:
        per_tensor = KVPolicy(dtype, dtype, group_size="tensor")
        named = any(gap.startswith(f"{dtype}:") for gap in _policy_gaps(per_tensor, arch, False))
        assert named == (dtype != "fp8")  # FP8 per tensor: what the nearest configs store

    paths = write_export(folder / "export", record, setup, DEVICE, "s", "knee")
    notes = (folder / "export" / "NOTES.md").read_text()
    if quantized and vllm.preset is None and sglang.preset is None:
        assert f"- {dtype}: {KV_DTYPE_INFO[dtype].description}" in notes
    exported = yaml.safe_load((folder / "export" / "vllm.yaml").read_text())
    assert exported["kv-cache-dtype"] == vllm.kv_cache_dtype
    assert KVPolicy.from_yaml((folder / "export" / "kvtune.yaml").read_text()) == policy
    assert {path.name for path in paths} == {
        "kvtune.yaml",
        "vllm.yaml",
        "sglang.args",
        "llama-server.args",
        "NOTES.md",
    }

    coarse = KVPolicy(dtype, dtype, **storage(dtype, arch.head_dim, group=64))
    plan = build_plan(arch, coarse, DEVICE, setup.serve)
    advised = any(dtype in w and "coarse scales" in w for w in plan.warnings)
    assert advised == (quantized and ELEMENT_FORMATS[dtype].few_levels)
    console = Console(file=io.StringIO(), width=200)
    render_plan(plan, console)
    shown = console.file.getvalue()
    assert f"K {dtype} / V {dtype}" in shown
    assert (f"g={coarse.group_size}/{coarse.scale_dtype}" in shown) == quantized

    order = most_precise_first(KV_DTYPES)
    bits = [ELEMENT_FORMATS[d].bits for d in order[1:]]
    assert order[0] == AUTO and dtype in order and bits == sorted(bits, reverse=True)

    # An exact dtype beside fp8, a quantized one beside fp16: the exact one is the baseline.
    exact = dtype if dtype not in QUANTIZED_DTYPES else "fp16"
    candidates = [dtype, "fp8" if dtype == exact else "fp16"]
    search = {
        "layer_groups": 1,
        "k_dtype": candidates,
        "v_dtype": candidates,
        "group_size": [fields["group_size"]],
        "scale_dtype": [fields["scale_dtype"]],
        "recent_unquantized": [0],
        "csa_ratio": [1],
        "csa_window": [128],
        "csa_sinks": [4],
        "block_size": [16],
        "chunk_size": [256],
    }
    space = SearchSpace(SearchConfig.from_dict(search, arch), (tuple(range(layers)),), layers)
    assert space.distributions()["k_dtype_g0"].choices == tuple(candidates)
    assert space.policy({"k_dtype_g0": dtype, "v_dtype_g0": dtype}).layer_pairs(layers) == (
        policy.layer_pairs(layers)
    )
    baseline = space.policy(space.warm_starts()["baseline"])
    assert baseline.layer_pairs(layers) == [(exact, exact)] * layers


def test_every_table_code_is_unique_and_prefix_free():
    codes = [info.table_code for info in KV_DTYPE_INFO.values()]
    assert len(set(codes)) == len(codes)
    assert not [(a, b) for a in codes for b in codes if a != b and b.startswith(a)]


def test_the_policy_accepts_auto_and_every_registered_format_but_fp32():
    """fp32 is only what auto stores for an fp32 model."""
    assert set(KV_DTYPES) == {AUTO, *ELEMENT_FORMATS} - {"fp32"}
    with pytest.raises(ConfigError) as error:
        KVPolicy(k_dtype="int9")
    assert all(name in str(error.value) for name in KV_DTYPES)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_every_policy_dtype_flows_through_every_consumer(dtype, tmp_path):
    check_consumers(dtype, tmp_path)


@pytest.mark.parametrize("dtype", [d for d in CSA_INDEX_DTYPES if d != INDEX_IN_LAYER_FORMAT])
def test_every_index_dtype_is_a_format_the_index_pool_can_hold(dtype):
    """A separate key-bounds index holds groups of 32 channels with fp16 scales."""
    setup = smollm_chat_setup()
    policy = KVPolicy(
        "fp8",
        "fp8",
        csa_ratio=2,
        csa_window=128,
        csa_topk=4,
        csa_host=True,
        csa_summary="none",
        csa_index_dtype=dtype,
    )
    policy.check_model(setup.arch)
    codes, _ = index_format(dtype).allocate(2, policy.block_size, 3, setup.arch.head_dim)
    assert codes.shape[:3] == (2, policy.block_size, 3)


# A format of an existing family (CODE_UINT + bits) registered as a new module would register
# it: its entry and nothing else. It is added before any consumer is imported, as an entry of
# the registry's dict is.
REGISTER_INT5 = """
from kvtune.kernels.formats import element_formats as registry
from kvtune.kernels.formats.int_codes import decode_codes_fast, encode_uint_ref, pack_codes_ref

registry.ELEMENT_FORMATS["int5"] = registry.ElementFormat(
    table_code="q5",
    description="5-bit asymmetric uniform integer codes (a test format)",
    nearest_engine="fp8",
    bits=5,
    code=registry.CODE_UINT + 5,
    encode=lambda u: pack_codes_ref(encode_uint_ref(u, 5), 5),
    decode=lambda packed: decode_codes_fast(packed, 5),
    max_code=31.0,
    zero_point=True,
)
"""
CHECK_INT5 = """
import json, sys
from pathlib import Path
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES, most_precise_first
from kvtune.runtime.policy import CSA_INDEX_DTYPES, GROUPED_DTYPES, INDEX_IN_LAYER_FORMAT, KVPolicy
from tests.autotune.test_format_consumers import check_consumers

check_consumers("int5", Path(sys.argv[1]))
messages = []
for build in (lambda: KVPolicy(k_dtype="int9"), lambda: KVPolicy(csa_index_dtype="int9")):
    try:
        build()
    except ConfigError as error:
        messages.append(str(error))
print(json.dumps({
    "kv_dtypes": KV_DTYPES,
    "index_dtypes": CSA_INDEX_DTYPES,
    "order": most_precise_first(KV_DTYPES),
    "messages": messages,
}))
"""


def test_a_new_format_reaches_every_consumer_with_no_other_edit(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", REGISTER_INT5 + CHECK_INT5, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert "int5" in seen["kv_dtypes"] and "int5" in seen["index_dtypes"]
    assert seen["order"].index("int8") < seen["order"].index("int5") < seen["order"].index("int4")
    assert all("int5" in message for message in seen["messages"])
