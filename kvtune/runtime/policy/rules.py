"""The rules between KVPolicy fields, each written once as a predicate over field values.

A rule reads a Mapping of field name -> value: a policy's own (`vars(policy)`), or a search
draw's knobs over the policy defaults. KVPolicy's validation raises a broken rule's one-line
ConfigError; the search space asks the same predicate of each draw and, where it fails, gives a
knob its fallback, so that every draw is a valid policy. The fields a rule reads have been
checked on their own first (fields.py), except csa_ratio, which only RATIO_FITS_A_BLOCK bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.kernels.formats.kv_format import ZERO_POINT_SCALE_DTYPES
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy.vocabulary import (
    CSA_RATIOS,
    FIXED_SCALE_DTYPES,
    GROUPED_DTYPES,
    INDEX_IN_LAYER_FORMAT,
    KEEP_GROUP,
    NO_SUMMARY,
    PER_TENSOR,
    POOLED_INDEXES,
    RESIDENT_STAGING,
    WHOLE_VECTOR_DTYPES,
    ZERO_POINT_DTYPES,
)

Fields = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    """A constraint between policy fields.

    reads: the fields `holds` reads (the search space checks some rules over every combination
        of their candidates).
    holds: whether field values satisfy the rule.
    blame: the field a broken rule's error names, the one to change (or a function of the
        values that picks it).
    allowed: what that field may be beside the others (the error's last part), or a function
        of the values that says it.
    """

    reads: tuple[str, ...]
    holds: Callable[[Fields], bool]
    blame: str | Callable[[Fields], str]
    allowed: str | Callable[[Fields], str]

    def check(self, fields: Fields) -> None:
        """Raise the rule's error where `fields` break it."""
        if not self.holds(fields):
            raise self.error(fields)

    def error(self, fields: Fields, section: str = "policy") -> ConfigError:
        """The one-line error of `fields` breaking the rule; `section` prefixes the field
        (search: the space's knob of that name)."""
        name = self.blame if isinstance(self.blame, str) else self.blame(fields)
        allowed = self.allowed if isinstance(self.allowed, str) else self.allowed(fields)
        value = fields[name]
        shown = list(value) if isinstance(value, tuple) else value  # per-layer lists as written
        return ConfigError(f"{section}.{name}", shown, allowed)


# What a policy does, derived from its fields (KVPolicy's properties of the same names).
def compressed(fields: Fields) -> bool:
    """Whether blocks that leave the window are compressed."""
    return fields["csa_ratio"] > 1


def summarises(fields: Fields) -> bool:
    """Whether blocks that leave the window are pooled into summaries."""
    return compressed(fields) and fields["csa_summary"] != NO_SUMMARY


def selects(fields: Fields) -> bool:
    """Whether queries read selected exact older blocks from the host tier."""
    return fields["csa_topk"] > 0


def pooled_index(fields: Fields) -> bool:
    """Whether selection scores blocks on bounds or means kept in an index pool."""
    return selects(fields) and fields["csa_index"] in POOLED_INDEXES


def separate_index(fields: Fields) -> bool:
    """Whether the index pool is in a dtype and basis of its own (csa_index_dtype not auto)."""
    return fields["csa_index_dtype"] != INDEX_IN_LAYER_FORMAT


def keeps(fields: Fields) -> bool:
    """Whether older blocks are kept exact on the device by importance."""
    return fields["csa_keep"] > 0


def key_group_field(fields: Fields) -> str:
    """The field that sets the keys' group size: k_group_size, or group_size when null."""
    return "group_size" if fields["k_group_size"] is None else "k_group_size"


def key_dtypes(fields: Fields) -> set[str]:
    """Every dtype a key stream is declared with (the default and each layer's)."""
    return {fields["k_dtype"], *(pair.split("/")[0] for pair in fields["layer_dtypes"] or ())}


def value_dtypes(fields: Fields) -> set[str]:
    """Every dtype a value stream is declared with (the default and each layer's)."""
    return {fields["v_dtype"], *(pair.split("/")[1] for pair in fields["layer_dtypes"] or ())}


# The fields that key_dtypes / value_dtypes and pooled_index read.
_STREAM_FIELDS = ("k_dtype", "v_dtype", "layer_dtypes")
_INDEX_POOL_FIELDS = ("csa_topk", "csa_index")


def _keep_span(fields: Fields) -> int:
    """Tokens of the window a keep group spans past its first block (decided as that block
    leaves the window, when the others must be complete and quantized)."""
    return (KEEP_GROUP - 1) * fields["block_size"]


def _ratios(fields: Fields) -> list[int]:
    return [r for r in CSA_RATIOS if r <= fields["block_size"]]


CHUNKS_ALIGN_WITH_BLOCKS = Rule(
    reads=("chunk_size", "block_size"),
    holds=lambda f: f["chunk_size"] % f["block_size"] == 0,
    blame="chunk_size",
    allowed=lambda f: f"a multiple of block_size={f['block_size']} (pages must stay aligned)",
)
RATIO_FITS_A_BLOCK = Rule(
    reads=("csa_ratio", "block_size"),
    holds=lambda f: not isinstance(f["csa_ratio"], bool) and f["csa_ratio"] in _ratios(f),
    blame="csa_ratio",
    allowed=lambda f: (
        f"a power of two up to block_size={f['block_size']}: {', '.join(map(str, _ratios(f)))}"
    ),
)
INDEX_DTYPE_NEEDS_AN_INDEX_POOL = Rule(
    reads=("csa_index_dtype", *_INDEX_POOL_FIELDS),
    holds=lambda f: not separate_index(f) or pooled_index(f),
    blame="csa_index_dtype",
    allowed=f"{INDEX_IN_LAYER_FORMAT} unless csa_topk > 0 with csa_index "
    f"{' or '.join(POOLED_INDEXES)} (it stores the bounds or means selection scores)",
)
SELECTION_NEEDS_COMPRESSION = Rule(
    reads=("csa_topk", "csa_ratio"),
    holds=lambda f: not selects(f) or compressed(f),
    blame=lambda f: "csa_topk" if f["layer_csa_topk"] is None else "layer_csa_topk",
    allowed=lambda f: (
        f"{0 if f['layer_csa_topk'] is None else 'null'} when csa_ratio is 1 "
        "(selection picks among compressed blocks)"
    ),
)
NO_SUMMARIES_NEED_AN_INDEX_POOL = Rule(
    reads=("csa_summary", *_INDEX_POOL_FIELDS),
    holds=lambda f: f["csa_summary"] != NO_SUMMARY or pooled_index(f),
    blame="csa_summary",
    allowed=f"pre_rope or post_rope unless csa_topk > 0 with csa_index "
    f"{' or '.join(POOLED_INDEXES)} (without summaries, only selection on an index pool reads "
    "older blocks)",
)
SELECTION_NEEDS_THE_HOST_TIER = Rule(
    reads=("csa_topk", "csa_host"),
    holds=lambda f: not selects(f) or f["csa_host"],
    blame="csa_host",
    allowed="true when csa_topk > 0 (the selected exact blocks live in the host tier)",
)
STREAMED_STAGING_NEEDS_SELECTION = Rule(
    reads=("csa_staging", "csa_topk"),
    holds=lambda f: f["csa_staging"] == RESIDENT_STAGING or selects(f),
    blame="csa_staging",
    allowed=f"{RESIDENT_STAGING} unless csa_topk > 0 (only selection fetches into staging)",
)
REUSE_NEEDS_SELECTION = Rule(
    reads=("csa_select_every", "csa_topk"),
    holds=lambda f: f["csa_select_every"] == 1 or selects(f),
    blame=lambda f: (
        "csa_select_every" if f["layer_csa_select_every"] is None else "layer_csa_select_every"
    ),
    allowed=lambda f: (
        f"{'1' if f['layer_csa_select_every'] is None else 'null'} unless "
        "csa_topk > 0 (it reuses a selection)"
    ),
)
RESCORE_NEEDS_SELECTION = Rule(
    reads=("csa_rescore", "csa_topk"),
    holds=lambda f: f["csa_rescore"] == 1 or selects(f),
    blame="csa_rescore",
    allowed="1 unless csa_topk > 0 (it rescores a selection's shortlist)",
)
HOST_TIER_NEEDS_SELECTION = Rule(
    reads=("csa_host", "csa_topk"),
    holds=lambda f: not f["csa_host"] or selects(f),
    blame="csa_topk",
    allowed="an integer >= 1 when csa_host is true (only selection reads the host tier)",
)
CHANNEL_KEYS_NEED_WHOLE_BLOCKS = Rule(
    reads=("k_scale_axis", "csa_ratio", "csa_summary", "csa_index_dtype"),
    holds=lambda f: (
        f["k_scale_axis"] != "channel"
        or not compressed(f)
        or (not summarises(f) and separate_index(f))
    ),
    blame="k_scale_axis",
    allowed="token when csa_ratio > 1, unless csa_summary is none with a csa_index_dtype other "
    "than auto (summaries and in-pool key bounds are written one vector at a time; per-channel "
    "scales need whole blocks)",
)
KEEP_NEEDS_COMPRESSION = Rule(
    reads=("csa_keep", "csa_ratio"),
    holds=lambda f: not keeps(f) or compressed(f),
    blame="csa_keep",
    allowed="0 when csa_ratio is 1 (it keeps compressed blocks)",
)
KEEP_EXCLUDES_SELECTION = Rule(
    reads=("csa_keep", "csa_topk"),
    holds=lambda f: not keeps(f) or not selects(f),
    blame="csa_keep",
    allowed="0 when csa_topk > 0 (importance-kept blocks and host-tier selection do not "
    "combine yet)",
)
KEEP_GROUP_FITS_THE_WINDOW = Rule(
    reads=("csa_keep", "csa_window", "block_size"),
    holds=lambda f: not keeps(f) or f["csa_window"] >= _keep_span(f),
    blame="csa_window",
    allowed=lambda f: (
        f">= {_keep_span(f)} ({KEEP_GROUP - 1} x block_size) when csa_keep > 0 "
        f"(a group of {KEEP_GROUP} blocks is decided when its first leaves the window)"
    ),
)
KEPT_BLOCKS_ARE_QUANTIZED = Rule(
    reads=("csa_keep", "recent_unquantized", "csa_window", "block_size"),
    holds=lambda f: not keeps(f) or f["recent_unquantized"] <= f["csa_window"] - _keep_span(f),
    blame="recent_unquantized",
    allowed=lambda f: (
        f"<= csa_window - {KEEP_GROUP - 1} x block_size = "
        f"{f['csa_window'] - _keep_span(f)} when csa_keep > 0 (kept blocks are copied from "
        "quantized codes)"
    ),
)
WINDOW_HOLDS_A_BLOCK = Rule(
    reads=("csa_ratio", "csa_window", "block_size"),
    holds=lambda f: not compressed(f) or f["csa_window"] >= f["block_size"],
    blame="csa_window",
    allowed=lambda f: (
        f">= block_size={f['block_size']} when csa_ratio > 1 (whole blocks leave the window)"
    ),
)


def _needing_groups(fields: Fields, keys: bool) -> list[str]:
    """The grouped formats (a zero point, a chosen scale or a scale word per group) of a stream
    whose group size is per tensor: none where it has a group size. Channel-scaled keys use no
    group size."""
    if keys:
        group = fields[key_group_field(fields)]
        dtypes = set() if fields["k_scale_axis"] == "channel" else key_dtypes(fields)
    else:
        group, dtypes = fields["group_size"], value_dtypes(fields)
    return sorted(dtypes & set(GROUPED_DTYPES)) if group == PER_TENSOR else []


def _zero_point_dtypes(fields: Fields) -> list[str]:
    return sorted((key_dtypes(fields) | value_dtypes(fields)) & set(ZERO_POINT_DTYPES))


def _foreign_scale_words(fields: Fields) -> list[str]:
    """Formats with scale words of their own dtype that scale_dtype does not name."""
    dtypes = (key_dtypes(fields) | value_dtypes(fields)) & set(FIXED_SCALE_DTYPES)
    return [d for d in sorted(dtypes) if FIXED_SCALE_DTYPES[d] != fields["scale_dtype"]]


def _whole_vector_keys(fields: Fields) -> list[str]:
    return sorted(key_dtypes(fields) & set(WHOLE_VECTOR_DTYPES))


VALUES_GROUPED = Rule(
    reads=("v_dtype", "layer_dtypes", "group_size"),
    holds=lambda f: not _needing_groups(f, keys=False),
    blame="group_size",
    allowed=lambda f: (
        f"a positive integer with {', '.join(_needing_groups(f, keys=False))} (scales per group)"
    ),
)
KEYS_GROUPED = Rule(
    reads=("k_dtype", "layer_dtypes", "group_size", "k_group_size", "k_scale_axis"),
    holds=lambda f: not _needing_groups(f, keys=True),
    blame=key_group_field,
    allowed=lambda f: (
        f"a positive integer with {', '.join(_needing_groups(f, keys=True))} (scales per group)"
    ),
)
ZERO_POINTS_NEED_THEIR_SCALE_DTYPE = Rule(
    reads=(*_STREAM_FIELDS, "scale_dtype"),
    holds=lambda f: not _zero_point_dtypes(f) or f["scale_dtype"] in ZERO_POINT_SCALE_DTYPES,
    blame="scale_dtype",
    allowed=lambda f: (
        f"one of {', '.join(ZERO_POINT_SCALE_DTYPES)} with "
        f"{', '.join(_zero_point_dtypes(f))} (zero points are stored in the scale dtype)"
    ),
)
FORMATS_KEEP_THEIR_SCALE_WORDS = Rule(
    reads=(*_STREAM_FIELDS, "scale_dtype"),
    holds=lambda f: not _foreign_scale_words(f),
    blame="scale_dtype",
    allowed=lambda f: (
        f"{FIXED_SCALE_DTYPES[_foreign_scale_words(f)[0]]} with "
        f"{_foreign_scale_words(f)[0]} (the format's own scale words)"
    ),
)
WHOLE_VECTOR_KEYS_SCALE_BY_TOKEN = Rule(
    reads=("k_dtype", "layer_dtypes", "k_scale_axis"),
    holds=lambda f: f["k_scale_axis"] != "channel" or not _whole_vector_keys(f),
    blame="k_scale_axis",
    allowed=lambda f: (
        f"token with {', '.join(_whole_vector_keys(f))} keys (its codes cover one whole vector)"
    ),
)

# Importance-kept blocks: all four hold, or csa_keep is 0.
KEEP_RULES = (
    KEEP_NEEDS_COMPRESSION,
    KEEP_EXCLUDES_SELECTION,
    KEEP_GROUP_FITS_THE_WINDOW,
    KEPT_BLOCKS_ARE_QUANTIZED,
)
# Grouped formats need a group size where each stream uses one.
GROUP_RULES = (VALUES_GROUPED, KEYS_GROUPED)
# Every rule, in the order validation checks them (a policy breaking several gets the first).
RULES: tuple[Rule, ...] = (
    CHUNKS_ALIGN_WITH_BLOCKS,
    RATIO_FITS_A_BLOCK,
    INDEX_DTYPE_NEEDS_AN_INDEX_POOL,
    SELECTION_NEEDS_COMPRESSION,
    NO_SUMMARIES_NEED_AN_INDEX_POOL,
    SELECTION_NEEDS_THE_HOST_TIER,
    STREAMED_STAGING_NEEDS_SELECTION,
    REUSE_NEEDS_SELECTION,
    RESCORE_NEEDS_SELECTION,
    HOST_TIER_NEEDS_SELECTION,
    CHANNEL_KEYS_NEED_WHOLE_BLOCKS,
    *KEEP_RULES,
    WINDOW_HOLDS_A_BLOCK,
    *GROUP_RULES,
    ZERO_POINTS_NEED_THEIR_SCALE_DTYPE,
    FORMATS_KEEP_THEIR_SCALE_WORDS,
    WHOLE_VECTOR_KEYS_SCALE_BY_TOKEN,
)
