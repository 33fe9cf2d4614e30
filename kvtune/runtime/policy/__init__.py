"""The KV-cache policy: the tunable settings, validated once for every entry point.

vocabulary.py: what each field may be (formats derived from the registries).
fields.py: one field's value checked and normalised.
rules.py: the rules between fields, each once, for validation and the search space alike.
schema.py: the KVPolicy dataclass (its fields, validation, dict/YAML form).
layers.py: per-layer fields parsed and expanded to every layer.
storage.py: each stream's storage format, and what a model's vectors cannot hold.
canonical.py: the one policy that stands for every policy storing the same cache.
"""

from kvtune.runtime.policy.canonical import canonical
from kvtune.runtime.policy.schema import KVPolicy
from kvtune.runtime.policy.vocabulary import (
    BLOCK_SIZES,
    BOUNDARY_PAIR,
    CSA_INDEX_DTYPES,
    CSA_INDEXES,
    CSA_RATIOS,
    CSA_STAGINGS,
    CSA_SUMMARIES,
    FIXED_SCALE_DTYPES,
    GROUPED_DTYPES,
    INDEX_GROUP,
    INDEX_IN_LAYER_FORMAT,
    INDEX_SCALE_DTYPE,
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

__all__ = [
    "BLOCK_SIZES",
    "BOUNDARY_PAIR",
    "CSA_INDEXES",
    "CSA_INDEX_DTYPES",
    "CSA_RATIOS",
    "CSA_STAGINGS",
    "CSA_SUMMARIES",
    "FIXED_SCALE_DTYPES",
    "GROUPED_DTYPES",
    "INDEX_GROUP",
    "INDEX_IN_LAYER_FORMAT",
    "INDEX_SCALE_DTYPE",
    "KEEP_FRACTIONS",
    "KEEP_GROUP",
    "K_SCALE_AXES",
    "NO_ROTATION",
    "NO_SUMMARY",
    "PER_TENSOR",
    "POOLED_INDEXES",
    "RESIDENT_STAGING",
    "ROTATION_NAMES",
    "SCALE_DTYPES",
    "WHOLE_VECTOR_DTYPES",
    "ZERO_POINT_DTYPES",
    "KVPolicy",
    "canonical",
]
