"""KVPolicy: the tunable KV-cache settings, validated once for every entry point.

The CLI, the runtime, the tuner and the exporter all build a KVPolicy, so a bad value is refused
with the same one-line message everywhere, before any model is loaded. Each field is declared
with its own check (fields.py, layers.py); then the rules between fields (rules.py) are checked
in order. Per-layer expansion (layers.py) and storage formats (storage.py) are reached through
the methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvtune.kernels.formats.kv_format import TENSOR_SCALES, KVFormat
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES
from kvtune.runtime.policy import layers, rules, storage
from kvtune.runtime.policy.fields import (
    Check,
    at_least,
    boolean,
    field_name,
    group_or_tensor,
    keep_fraction,
    one_of,
    optional,
)
from kvtune.runtime.policy.vocabulary import (
    BLOCK_SIZES,
    CSA_INDEX_DTYPES,
    CSA_INDEXES,
    CSA_STAGINGS,
    CSA_SUMMARIES,
    INDEX_IN_LAYER_FORMAT,
    K_SCALE_AXES,
    KEEP_GROUP,
    NO_ROTATION,
    RESIDENT_STAGING,
    ROTATION_NAMES,
    SCALE_DTYPES,
)


def _checked(default: Any, check: Check) -> Any:
    """A field with its default and the check of its value on its own."""
    return dataclasses.field(default=default, metadata={"check": check})


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
        its per-channel key max and min, kept in one device slot a block; Quest: stored rounded
        outward, so that read back they bound every key of the block in every separate
        csa_index_dtype and in grouped layer formats, while an auto index in a per-tensor layer
        format clips at its range and in Lloyd-Max codes rounds to nearest), means (q.k with
        the mean of the block's cached keys, one K slot a block: half the bounds' bytes, but on
        SmolLM2 it loses multi-token retrieval) or summaries (the attention its summaries get;
        no extra bytes).
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
        (SmolLM2 held out: 0.959 at 1, 0.941 at 2, 0.772 at 4; benchmarks/RESULTS.md, "CSA pooling
        and selection").
    csa_rescore: N > 1 makes selection two-stage: the index shortlists N x the layer's budget
        of blocks, and each KV head keeps the budget whose exact keys (the host tier's) give
        any of its query heads the largest logit (kvtune/kernels/selection/rescore.py). Costs
        no device bytes; a decode step reads the shortlist's keys from the host tier.
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
        dtype), or llamacpp: llama.cpp's Walsh-Hadamard blocks, on the quantized streams only.
        It costs no cache bytes.
    tensor_scale: calibrated (each layer's fp32 K and V tensor scales are measured on a fixed
        text, for per-tensor and E4M3-scaled streams) or unit (1, as vLLM and SGLang use without
        checkpoint k_scale / v_scale: the engine presets).
    boundary_layers: the first and last N layers (at most half the model each) are cached in
        fp16 whatever the dtypes say; vLLM's turboquant_* caches keep 2 in the model dtype
        (16-bit on every GPU deployment; fp16 here, so that an fp32 CPU run counts the bytes
        vLLM allocates).
    """

    k_dtype: str = _checked("fp16", one_of(KV_DTYPES))
    v_dtype: str = _checked("fp16", one_of(KV_DTYPES))
    layer_dtypes: tuple[str, ...] | None = _checked(None, layers.layer_dtypes)
    group_size: int | str = _checked(32, group_or_tensor)
    k_group_size: int | str | None = _checked(None, optional(group_or_tensor))
    scale_dtype: str = _checked("fp16", one_of(SCALE_DTYPES))
    k_scale_axis: str = _checked("token", one_of(K_SCALE_AXES))
    recent_unquantized: int = _checked(0, at_least(0))
    csa_ratio: int = 1  # bounded by block_size: rules.RATIO_FITS_A_BLOCK
    csa_window: int = _checked(512, at_least(0))
    csa_sinks: int = _checked(16, at_least(0))
    csa_summary: str = _checked("pre_rope", one_of(CSA_SUMMARIES))
    csa_topk: int = _checked(0, at_least(0))
    layer_csa_topk: tuple[int, ...] | None = _checked(None, layers.layer_budgets)
    csa_index: str = _checked("bounds", one_of(CSA_INDEXES))
    csa_index_dtype: str = _checked(INDEX_IN_LAYER_FORMAT, one_of(CSA_INDEX_DTYPES))
    csa_host: bool = _checked(False, boolean)
    csa_staging: str = _checked(RESIDENT_STAGING, one_of(CSA_STAGINGS))
    csa_select_every: int = _checked(1, at_least(1))
    layer_csa_select_every: tuple[int, ...] | None = _checked(None, layers.layer_ints(1))
    csa_rescore: int = _checked(1, at_least(1))
    csa_keep: float = _checked(0.0, keep_fraction)
    block_size: int = _checked(16, one_of(BLOCK_SIZES))
    chunk_size: int = _checked(512, at_least(1))
    rotation: str = _checked(NO_ROTATION, one_of(ROTATION_NAMES))
    tensor_scale: str = _checked("calibrated", one_of(TENSOR_SCALES))
    boundary_layers: int = _checked(0, at_least(0))

    def __post_init__(self) -> None:
        """Each field checked on its own, then the plain fields of per-layer lists set, then the
        rules between fields checked in order: a policy breaking several gets the first."""
        for field in dataclasses.fields(self):
            value = self.checked_field(field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        for name, unset, why in layers.TAKE_LARGEST:
            object.__setattr__(self, name, layers.largest(vars(self), name, unset, why))
        for rule in rules.RULES:
            rule.check(vars(self))

    @classmethod
    def checked_field(cls, name: str, value: Any) -> Any:
        """One field's value checked on its own (not the rules between fields) and normalised,
        as validation does; the search space checks its candidates with it."""
        check = cls.__dataclass_fields__[name].metadata.get("check")
        return value if check is None else check(name, value)

    @property
    def key_group_field(self) -> str:
        """The field that sets the keys' group size, for error messages."""
        return rules.key_group_field(vars(self))

    @property
    def key_group_size(self) -> int | str:
        """The keys' group_size (k_group_size, or group_size when that is null)."""
        return getattr(self, self.key_group_field)

    @property
    def keeps(self) -> bool:
        """Whether older blocks are kept exact on the device by importance."""
        return rules.keeps(vars(self))

    @property
    def kept_per_group(self) -> int:
        """Blocks kept exact out of every KEEP_GROUP consecutive older blocks."""
        return round(self.csa_keep * KEEP_GROUP)

    @property
    def selects(self) -> bool:
        """Whether queries read selected exact older blocks from the host tier."""
        return rules.selects(vars(self))

    @property
    def streams_staging(self) -> bool:
        """Whether the layers share one staging pool, filled by each in turn every step."""
        return self.selects and self.csa_staging != RESIDENT_STAGING

    @property
    def pooled_index(self) -> bool:
        """Whether selection scores blocks on bounds or means kept in an index pool."""
        return rules.pooled_index(vars(self))

    @property
    def separate_index(self) -> bool:
        """Whether the index pool is in a dtype and basis of its own (csa_index_dtype not
        auto)."""
        return rules.separate_index(vars(self))

    @property
    def compressed(self) -> bool:
        """Whether blocks that leave the window are compressed."""
        return rules.compressed(vars(self))

    @property
    def summarises(self) -> bool:
        """Whether blocks that leave the window are pooled into summaries."""
        return rules.summarises(vars(self))

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

    def check_context(self, tokens: int, field: str) -> None:
        """Refuse a selection budget that reads a whole `tokens`-token context: sinks, window
        and csa_topk blocks would hold every token, so selection would choose nothing (and the
        bytes would be no test of it)."""
        read = self.csa_sinks + self.csa_window + self.csa_topk * self.block_size
        if self.selects and read >= tokens:
            most = max(0, (tokens - 1 - self.csa_sinks - self.csa_window) // self.block_size)
            raise ConfigError(
                "policy.csa_topk",
                self.csa_topk,
                f"at most {most} at {field}={tokens} (csa_sinks + csa_window + csa_topk x "
                f"block_size = {read} tokens would read the whole context)",
            )

    def check_model(self, arch: ModelArch) -> None:
        """Refuse settings this model cannot hold (before its weights are loaded)."""
        storage.check_model(self, arch)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, ints, strings) for YAML, MLflow params and Hydra."""
        data = dataclasses.asdict(self)
        return {name: list(v) if isinstance(v, tuple) else v for name, v in data.items()}

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
        return cls(**data)  # per-layer lists become tuples as they are checked

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
