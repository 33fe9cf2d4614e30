"""KVPolicy: the tunable KV-cache settings, validated once for every entry point.

The CLI, the runtime, the tuner and the exporter all build a KVPolicy, so a bad value is refused
with the same one-line message everywhere, before any model is loaded. The class holds the
fields, their validation and their dict/YAML form; per-layer expansion (layers.py) and storage
formats (storage.py) are reached through its methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kvtune.kernels.formats.kv_format import TENSOR_SCALES, ZERO_POINT_SCALE_DTYPES, KVFormat
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import layers, storage
from kvtune.runtime.policy.fields import (
    check_dtype,
    check_int,
    field_name,
    normalised_group_size,
)
from kvtune.runtime.policy.layers import parse_layer_pair
from kvtune.runtime.policy.vocabulary import (
    BLOCK_SIZES,
    CSA_INDEX_DTYPES,
    CSA_INDEXES,
    CSA_STAGINGS,
    CSA_SUMMARIES,
    FIXED_SCALE_DTYPES,
    GROUPED_DTYPES,
    INDEX_IN_LAYER_FORMAT,
    K_SCALE_AXES,
    KEEP_FRACTIONS,
    KEEP_GROUP,
    NO_ROTATION,
    NO_SUMMARY,
    PER_TENSOR,
    POOLED_INDEXES,
    RESIDENT_STAGING,
    ROTATION_NAMES,
    SCALE_DTYPES,
    WHOLE_VECTOR_DTYPES,
    ZERO_POINT_DTYPES,
)


@dataclass(frozen=True)
class KVPolicy:
    """Tunable KV-cache policy.

    k_dtype, v_dtype: default element format of keys and values in every layer: auto (the
        model's compute dtype, the exact reference path) or a registered element format
        (kvtune/kernels/formats/element_formats.py: fp16, bf16, fp8 (E4M3), fp4 (E2M1), the
        asymmetric uniform int8 ... int2 with a scale and a zero point per group, the engines'
        own formats, ...; KV_DTYPES lists them).
    layer_dtypes: optional "K/V" pair per layer overriding the defaults, e.g. ("fp8/fp4", ...).
    group_size: elements along head_dim sharing one scale, or "tensor" for one scale per layer
        and per K/V (fp8/fp4 only: the integer formats need a group). Only quantized streams
        store scales. lloyd4 / lloyd3 code whole vectors: their group_size is head_dim.
    k_group_size: the keys' group_size where it differs from the values' (null: group_size);
        vLLM's turboquant_k8v4 keeps fp8 keys per tensor beside per-vector value scales.
    scale_dtype: fp16 group scales, e4m3 (NVFP4-style, with an fp32 per-tensor scale), fp32
        (vLLM's per-token-head scales) or ue8m0 (powers of two, MX-style); see
        kvtune/kernels/formats/scale_formats.py. The integer formats need fp16: their zero points
        are stored in the scale dtype.
    k_scale_axis: token (keys grouped along head_dim per token, like values), or channel (one
        scale per channel per block of block_size keys, KIVI-style: fixed outlier channels no
        longer set every token's scale). A channel-scaled block is quantized once full; until
        then it stays in fp16 with the recent tokens, and those bytes count.
    recent_unquantized: the most recent tokens kept in fp16 (0 = none); a block is quantized
        once it holds none of them.
    csa_ratio: tokens pooled into one summary K/V (1 = no compression).
    csa_window: the most recent tokens kept exact when compressing.
    csa_sinks: the first tokens kept exact when compressing.
    csa_summary: pre_rope (keys turned to their group's centre before the mean, so RoPE does
        not cancel them), post_rope (the mean of the cached keys), or none (no summaries: with
        selection, a query reads sinks, window and its selected blocks only, as Quest does;
        selection then keeps as much accuracy and the summary bytes go to selected blocks).
    csa_topk: older blocks (outside sinks and window) each query reads exactly, chosen per
        query and layer by its attention to their summaries (0 = none: summaries only).
    layer_csa_topk: optional budget per layer overriding csa_topk (PyramidKV-style: more blocks
        where layers retrieve, fewer where they attend locally; 0 = that layer reads sinks,
        window and summaries only). csa_topk is then their largest (0 takes it): a sequence's
        staging blocks, which every layer shares, so device bytes follow the largest budget;
        the fetched bytes and the blocks attended follow each layer's own.
    csa_index: how selection scores a block: bounds (an upper bound of q.k over the block from
        its per-channel key max and min, kept in one device slot a block; Quest), means (q.k
        with the mean of the block's cached keys, one K slot a block: half the bounds' bytes,
        but on SmolLM2 it loses multi-token retrieval) or summaries (the attention its
        summaries get; no extra bytes).
    csa_index_dtype: where bounds or means live: auto (one slot a block in the layer's
        formats and rotated space), or a dtype of CSA_INDEX_DTYPES (fp16, fp8, int8, int4, ...:
        any whose codes take groups of 32 channels with fp16 scales): a separate index pool in
        the model's basis, which per-channel keys need beside selection.
    csa_host: keep the exact older blocks in a host-memory tier (CUDA: pinned host memory; a
        CPU has a second pool), from which selected blocks are fetched into a device staging
        pool of csa_topk blocks a sequence. Device bytes count the staging pool, not the tier.
    csa_staging: resident (every layer holds its own staging pool and refetches only the
        blocks its heads newly chose) or streamed (one staging pool, in each distinct layer
        format, that the layers fill in turn: every step fetches every layer's choice, for
        about 1 / num_layers of the staging bytes; ShadowKV, InfiniGen).
    csa_select_every: N > 1 reuses a choice for N positions (LServe's reusable page
        selector): a query is scored by the query at its anchor, the latest position that is a
        multiple of N, over the older blocks it sees itself. A decode step between anchors
        reuses the staged choice (no scoring, no fetch, no host sync) unless a block has left
        the window since; prefill scores its queries by the same anchors, so teacher-forced
        accuracy measures what decode does. The lag costs recall where one query retrieves
        (SmolLM2 held out: 0.959 at 1, 0.941 at 2, 0.772 at 4; benchmarks/RESULTS.md).
    layer_csa_select_every: optional N per layer overriding csa_select_every (then their
        largest): reuse where layers attend locally, choose at every query where they retrieve.
    csa_keep: fraction of older blocks kept exact on the device beside their summaries, chosen
        per layer and KV head by the attention they received while in the window (H2O /
        SnapKV style, from queries that already ran): in every group of 8 consecutive older
        blocks, the csa_keep * 8 that got the most. 0 = none.
    block_size: tokens a paged block holds.
    chunk_size: prefill chunk in tokens, a multiple of block_size.
    rotation: none, or hadamard: an orthonormal randomized Hadamard rotation of K and V along
        head_dim in every layer with a quantized K or V stream, applied before they are cached
        (queries rotated alike, the attention output rotated back;
        kvtune/kernels/formats/rotation.py), or vllm_rht: vLLM's int4_per_token_head transform
        (unnormalized, one sign vector for all layers, rotated K and V cast back to the model
    dtype). It costs no cache bytes. tensor_scale: calibrated (each layer's fp32 K and V tensor
        scales are measured on a fixed text, for per-tensor and E4M3-scaled streams) or unit (1, as
        vLLM and SGLang use without checkpoint k_scale / v_scale: the engine presets).
    boundary_layers: the first and last N layers (at most half the model each) are cached in
        fp16 whatever the dtypes say; vLLM's turboquant_* caches keep 2 in the model dtype
        (16-bit on every GPU deployment; fp16 here, so that an fp32 CPU run counts the bytes
        vLLM allocates).
    """

    k_dtype: str = "fp16"
    v_dtype: str = "fp16"
    layer_dtypes: tuple[str, ...] | None = None
    group_size: int | str = 32
    k_group_size: int | str | None = None
    scale_dtype: str = "fp16"
    k_scale_axis: str = "token"
    recent_unquantized: int = 0
    csa_ratio: int = 1
    csa_window: int = 512
    csa_sinks: int = 16
    csa_summary: str = "pre_rope"
    csa_topk: int = 0
    layer_csa_topk: tuple[int, ...] | None = None
    csa_index: str = "bounds"
    csa_index_dtype: str = INDEX_IN_LAYER_FORMAT
    csa_host: bool = False
    csa_staging: str = RESIDENT_STAGING
    csa_select_every: int = 1
    layer_csa_select_every: tuple[int, ...] | None = None
    csa_keep: float = 0.0
    block_size: int = 16
    chunk_size: int = 512
    rotation: str = NO_ROTATION
    tensor_scale: str = "calibrated"
    boundary_layers: int = 0

    def __post_init__(self) -> None:
        check_dtype("k_dtype", self.k_dtype)
        check_dtype("v_dtype", self.v_dtype)
        if self.layer_dtypes is not None:
            if isinstance(self.layer_dtypes, str) or not isinstance(self.layer_dtypes, Sequence):
                raise ConfigError(
                    field_name("layer_dtypes"), self.layer_dtypes, 'a list of "K/V" pairs, or null'
                )
            pairs = tuple(parse_layer_pair(i, p) for i, p in enumerate(self.layer_dtypes))
            object.__setattr__(self, "layer_dtypes", pairs or None)
        object.__setattr__(self, "group_size", normalised_group_size("group_size", self.group_size))
        if self.k_group_size is not None:
            k_group = normalised_group_size("k_group_size", self.k_group_size)
            object.__setattr__(self, "k_group_size", k_group)
        check_int("boundary_layers", self.boundary_layers, 0)
        if self.scale_dtype not in SCALE_DTYPES:
            raise ConfigError(
                field_name("scale_dtype"), self.scale_dtype, f"one of {', '.join(SCALE_DTYPES)}"
            )
        if self.k_scale_axis not in K_SCALE_AXES:
            raise ConfigError(
                field_name("k_scale_axis"), self.k_scale_axis, f"one of {', '.join(K_SCALE_AXES)}"
            )
        check_int("recent_unquantized", self.recent_unquantized, 0)
        check_int("csa_window", self.csa_window, 0)
        check_int("csa_sinks", self.csa_sinks, 0)
        if self.block_size not in BLOCK_SIZES or isinstance(self.block_size, bool):
            raise ConfigError(
                field_name("block_size"),
                self.block_size,
                f"one of {', '.join(map(str, BLOCK_SIZES))}",
            )
        check_int("chunk_size", self.chunk_size, 1)
        if self.chunk_size % self.block_size:
            raise ConfigError(
                field_name("chunk_size"),
                self.chunk_size,
                f"a multiple of block_size={self.block_size} (pages must stay aligned)",
            )
        self._check_compression()
        self._check_integer_formats()
        if self.rotation not in ROTATION_NAMES:
            raise ConfigError(
                field_name("rotation"), self.rotation, f"one of {', '.join(ROTATION_NAMES)}"
            )
        if self.tensor_scale not in TENSOR_SCALES:
            raise ConfigError(
                field_name("tensor_scale"), self.tensor_scale, f"one of {', '.join(TENSOR_SCALES)}"
            )

    @property
    def key_group_field(self) -> str:
        """The field that sets the keys' group size, for error messages."""
        return "group_size" if self.k_group_size is None else "k_group_size"

    @property
    def key_group_size(self) -> int | str:
        """The keys' group_size (k_group_size, or group_size when that is null)."""
        return self.group_size if self.k_group_size is None else self.k_group_size

    def _check_integer_formats(self) -> None:
        """The asymmetric integer formats keep a zero point per group in the scale dtype, so
        they need fp16 scales, and a group_size wherever they use it (channel keys do not)."""
        pairs = [pair.split("/") for pair in self.layer_dtypes or ()]
        keys = {self.k_dtype, *(k for k, _ in pairs)}
        values = {self.v_dtype, *(v for _, v in pairs)}
        integer = sorted((keys | values) & set(ZERO_POINT_DTYPES))
        grouped_keys = set() if self.k_scale_axis == "channel" else keys
        for name, group, dtypes in (
            ("group_size", self.group_size, values),
            (self.key_group_field, self.key_group_size, grouped_keys),
        ):
            needing = sorted(dtypes & set(GROUPED_DTYPES))
            if group == PER_TENSOR and needing:
                raise ConfigError(
                    field_name(name),
                    group,
                    f"a positive integer with {', '.join(needing)} (scales per group)",
                )
        if integer and self.scale_dtype not in ZERO_POINT_SCALE_DTYPES:
            raise ConfigError(
                field_name("scale_dtype"),
                self.scale_dtype,
                f"one of {', '.join(ZERO_POINT_SCALE_DTYPES)} with {', '.join(integer)} "
                "(zero points are stored in the scale dtype)",
            )
        for dtype in sorted((keys | values) & set(FIXED_SCALE_DTYPES)):
            needed = FIXED_SCALE_DTYPES[dtype]
            if self.scale_dtype != needed:
                raise ConfigError(
                    field_name("scale_dtype"),
                    self.scale_dtype,
                    f"{needed} with {dtype} (the format's own scale words)",
                )
        whole = sorted(keys & set(WHOLE_VECTOR_DTYPES))
        if whole and self.k_scale_axis == "channel":
            raise ConfigError(
                field_name("k_scale_axis"),
                self.k_scale_axis,
                f"token with {', '.join(whole)} keys (its codes cover one whole vector)",
            )

    def _check_compression(self) -> None:
        ratio = self.csa_ratio
        ratios = [r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r <= self.block_size]
        if ratio not in ratios or isinstance(ratio, bool):
            raise ConfigError(
                field_name("csa_ratio"),
                ratio,
                f"a power of two up to block_size={self.block_size}: {', '.join(map(str, ratios))}",
            )
        if self.csa_summary not in CSA_SUMMARIES:
            raise ConfigError(
                field_name("csa_summary"), self.csa_summary, f"one of {', '.join(CSA_SUMMARIES)}"
            )
        self._check_selection()
        channel = self.k_scale_axis == "channel"
        if ratio > 1 and channel and (self.summarises or not self.separate_index):
            raise ConfigError(
                field_name("k_scale_axis"),
                self.k_scale_axis,
                "token when csa_ratio > 1, unless csa_summary is none with a csa_index_dtype "
                "other than auto (summaries and in-pool key bounds are written one vector at a "
                "time; per-channel scales need whole blocks)",
            )
        self._check_keep()
        if ratio > 1 and self.csa_window < self.block_size:
            raise ConfigError(
                field_name("csa_window"),
                self.csa_window,
                f">= block_size={self.block_size} when csa_ratio > 1 "
                "(whole blocks leave the window)",
            )

    def _check_selection(self) -> None:
        """Selection reads exact older blocks, which only the host tier keeps, and the tier
        is read only by selection."""
        check_int("csa_topk", self.csa_topk, 0)
        self._normalise_layer_topk()
        if self.csa_index not in CSA_INDEXES:
            raise ConfigError(
                field_name("csa_index"), self.csa_index, f"one of {', '.join(CSA_INDEXES)}"
            )
        if not isinstance(self.csa_host, bool):
            raise ConfigError(field_name("csa_host"), self.csa_host, "true or false")
        if self.csa_index_dtype not in CSA_INDEX_DTYPES:
            raise ConfigError(
                field_name("csa_index_dtype"),
                self.csa_index_dtype,
                f"one of {', '.join(CSA_INDEX_DTYPES)}",
            )
        if self.csa_index_dtype != INDEX_IN_LAYER_FORMAT and not self.pooled_index:
            raise ConfigError(
                field_name("csa_index_dtype"),
                self.csa_index_dtype,
                f"{INDEX_IN_LAYER_FORMAT} unless csa_topk > 0 with csa_index "
                f"{' or '.join(POOLED_INDEXES)} (it stores the bounds or means selection scores)",
            )
        if self.csa_topk and self.csa_ratio == 1:
            budgets = self.layer_csa_topk
            raise ConfigError(
                field_name("csa_topk" if budgets is None else "layer_csa_topk"),
                self.csa_topk if budgets is None else list(budgets),
                f"{0 if budgets is None else 'null'} when csa_ratio is 1 (selection picks among "
                "compressed blocks)",
            )
        if self.csa_summary == NO_SUMMARY and not self.pooled_index:
            raise ConfigError(
                field_name("csa_summary"),
                self.csa_summary,
                f"pre_rope or post_rope unless csa_topk > 0 with csa_index "
                f"{' or '.join(POOLED_INDEXES)} (without summaries, only selection on an index "
                "pool reads older blocks)",
            )
        if self.csa_topk and not self.csa_host:
            raise ConfigError(
                field_name("csa_host"),
                self.csa_host,
                "true when csa_topk > 0 (the selected exact blocks live in the host tier)",
            )
        if self.csa_staging not in CSA_STAGINGS:
            raise ConfigError(
                field_name("csa_staging"), self.csa_staging, f"one of {', '.join(CSA_STAGINGS)}"
            )
        if self.csa_staging != RESIDENT_STAGING and not self.csa_topk:
            raise ConfigError(
                field_name("csa_staging"),
                self.csa_staging,
                f"{RESIDENT_STAGING} unless csa_topk > 0 (only selection fetches into staging)",
            )
        check_int("csa_select_every", self.csa_select_every, 1)
        self._normalise_layer_select_every()
        if self.csa_select_every > 1 and not self.csa_topk:
            name = (
                "csa_select_every"
                if self.layer_csa_select_every is None
                else "layer_csa_select_every"
            )
            raise ConfigError(
                field_name(name),
                getattr(self, name),
                f"{'1' if name == 'csa_select_every' else 'null'} unless csa_topk > 0 (it reuses "
                "a selection)",
            )
        if self.csa_host and not self.csa_topk:
            raise ConfigError(
                field_name("csa_topk"),
                self.csa_topk,
                "an integer >= 1 when csa_host is true (only selection reads the host tier)",
            )

    def _normalise_layer_select_every(self) -> None:
        """Per-layer reuse as a tuple of integers >= 1, csa_select_every their largest."""
        everies = self._layer_ints("csa_select_every", 1)
        if everies is not None:
            self._take_largest("csa_select_every", everies, 1, "")

    def _normalise_layer_topk(self) -> None:
        """Per-layer budgets as a tuple of integers, csa_topk their largest (the staging blocks
        a sequence holds; 0 takes it)."""
        budgets = self._layer_ints("csa_topk", 0)
        if budgets is None:
            return
        if max(budgets) == 0:
            raise ConfigError(
                field_name("layer_csa_topk"),
                list(budgets),
                "a list with a budget above 0, or null (a policy without selection has csa_topk 0)",
            )
        self._take_largest("csa_topk", budgets, 0, " (the staging blocks a sequence holds)")

    def _layer_ints(self, name: str, minimum: int) -> tuple[int, ...] | None:
        """Field layer_<name> as a tuple of integers >= minimum (None when unset)."""
        layer_field = "layer_" + name
        values = getattr(self, layer_field)
        if values is None:
            return None
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ConfigError(
                field_name(layer_field),
                values,
                f"a list of integers >= {minimum} (one a layer), or null",
            )
        return tuple(check_int(f"{layer_field}[{i}]", v, minimum) for i, v in enumerate(values))

    def _take_largest(self, name: str, values: tuple[int, ...], unset: int, why: str) -> None:
        """Store `values` as layer_<name> and their largest as `name`, which must be unset (its
        `unset` value) or already that largest."""
        if getattr(self, name) not in (unset, max(values)):
            raise ConfigError(
                field_name(name),
                getattr(self, name),
                f"{max(values)}, the largest layer_{name}{why}, or {unset} to take it",
            )
        object.__setattr__(self, "layer_" + name, values)
        object.__setattr__(self, name, max(values))

    def _check_keep(self) -> None:
        """Kept blocks are decided when a group's first block leaves the window, from codes
        in the layer's format: every block of the group must be complete and quantized then."""
        keep = self.csa_keep
        allowed = ", ".join(f"{f:g}" for f in KEEP_FRACTIONS)
        number = isinstance(keep, int | float) and not isinstance(keep, bool)
        if not number or keep not in KEEP_FRACTIONS:
            raise ConfigError(field_name("csa_keep"), keep, f"one of {allowed}")
        object.__setattr__(self, "csa_keep", float(keep))  # 0 and 0.0: one policy, one key
        if not keep:
            return
        if self.csa_ratio == 1:
            raise ConfigError(
                field_name("csa_keep"), keep, "0 when csa_ratio is 1 (it keeps compressed blocks)"
            )
        if self.csa_topk:
            raise ConfigError(
                field_name("csa_keep"),
                keep,
                "0 when csa_topk > 0 (importance-kept blocks and host-tier selection do not "
                "combine yet)",
            )
        span = (KEEP_GROUP - 1) * self.block_size
        if self.csa_window < span:
            raise ConfigError(
                field_name("csa_window"),
                self.csa_window,
                f">= {span} ({KEEP_GROUP - 1} x block_size) when csa_keep > 0 (a group of "
                f"{KEEP_GROUP} blocks is decided when its first leaves the window)",
            )
        if self.recent_unquantized > self.csa_window - span:
            raise ConfigError(
                field_name("recent_unquantized"),
                self.recent_unquantized,
                f"<= csa_window - {KEEP_GROUP - 1} x block_size = {self.csa_window - span} when "
                "csa_keep > 0 "
                "(kept blocks are copied from quantized codes)",
            )

    @property
    def keeps(self) -> bool:
        """Whether older blocks are kept exact on the device by importance."""
        return self.csa_keep > 0

    @property
    def kept_per_group(self) -> int:
        """Blocks kept exact out of every KEEP_GROUP consecutive older blocks."""
        return round(self.csa_keep * KEEP_GROUP)

    @property
    def selects(self) -> bool:
        """Whether queries read selected exact older blocks from the host tier."""
        return self.csa_topk > 0

    @property
    def streams_staging(self) -> bool:
        """Whether the layers share one staging pool, filled by each in turn every step."""
        return self.selects and self.csa_staging != RESIDENT_STAGING

    @property
    def pooled_index(self) -> bool:
        """Whether selection scores blocks on bounds or means kept in an index pool."""
        return self.selects and self.csa_index in POOLED_INDEXES

    @property
    def separate_index(self) -> bool:
        """Whether the index pool is in a dtype and basis of its own (csa_index_dtype not
        auto)."""
        return self.csa_index_dtype != INDEX_IN_LAYER_FORMAT

    @property
    def compressed(self) -> bool:
        return self.csa_ratio > 1

    @property
    def summarises(self) -> bool:
        """Whether blocks that leave the window are pooled into summaries."""
        return self.compressed and self.csa_summary != NO_SUMMARY

    @property
    def recent_tail(self) -> bool:
        """Whether new tokens go to an fp16 pool first: for the recent region, or until a
        channel-scaled key block is full."""
        return self.recent_unquantized > 0 or self.k_scale_axis == "channel"

    def layer_pairs(self, num_layers: int) -> list[tuple[str, str]]:
        """(K dtype, V dtype) of every layer, with the per-layer overrides applied."""
        return layers.layer_pairs(self, num_layers)

    def layer_topk(self, num_layers: int) -> list[int]:
        """Older blocks each query reads exactly, layer by layer (csa_topk everywhere unless
        layer_csa_topk gives each layer its own)."""
        return layers.per_layer(self, "csa_topk", "budget", num_layers)

    def layer_select_every(self, num_layers: int) -> list[int]:
        """Positions one selection serves, layer by layer (csa_select_every everywhere unless
        layer_csa_select_every gives each layer its own)."""
        return layers.per_layer(self, "csa_select_every", "N", num_layers)

    def kv_format(self, dtype: str, auto_dtype: str, keys: bool = False) -> KVFormat:
        """Storage format of a stream whose element dtype is `dtype` (auto -> the model's);
        keys: the stream holds keys (k_scale_axis applies)."""
        return storage.kv_format(self, dtype, auto_dtype, keys)

    def check_model(self, arch: ModelArch) -> None:
        """Refuse settings this model cannot hold (before its weights are loaded)."""
        storage.check_model(self, arch)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strings) for YAML, MLflow params and Hydra."""
        data = dataclasses.asdict(self)
        for name in ("layer_dtypes", "layer_csa_topk", "layer_csa_select_every"):
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVPolicy:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(
                    field_name(str(key)),
                    data[key],
                    f"unknown field; known: {', '.join(sorted(known))}",
                )
        values = dict(data)
        for name in ("layer_dtypes", "layer_csa_topk", "layer_csa_select_every"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        return cls(**values)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> KVPolicy:
        data = yaml.safe_load(text) or {}
        if not isinstance(data, Mapping):
            raise ConfigError("policy", data, "a YAML mapping of policy fields")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> KVPolicy:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
