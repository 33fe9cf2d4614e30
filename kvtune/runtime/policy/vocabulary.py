"""What each KVPolicy field may be: the names and sizes validation accepts and the search space
draws from. Element and scale formats are derived from their registries
(`kvtune.kernels.formats.element_formats`, `scale_formats`), never listed here.
"""

from __future__ import annotations

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.rotation import ROTATIONS
from kvtune.kernels.formats.scale_formats import SCALE_FORMATS
from kvtune.runtime.kv_dtypes import AUTO, KV_DTYPES

# Asymmetric formats: a zero point beside each group scale (no per-tensor form, no E4M3 scales).
ZERO_POINT_DTYPES: tuple[str, ...] = tuple(
    name for name, element in ELEMENT_FORMATS.items() if element.zero_point
)
# Formats that keep something per group (a zero point, a chosen scale, a scale word of a fixed
# dtype), so no per-tensor form.
GROUPED_DTYPES: tuple[str, ...] = tuple(
    name
    for name, element in ELEMENT_FORMATS.items()
    if element.zero_point or element.alt_max_code or element.scale_dtype
)
FIXED_SCALE_DTYPES: dict[str, str] = {
    name: element.scale_dtype
    for name, element in ELEMENT_FORMATS.items()
    if element.scale_dtype is not None
}
# Formats whose one group is a whole vector (group_size = head_dim).
WHOLE_VECTOR_DTYPES: tuple[str, ...] = tuple(
    name for name, element in ELEMENT_FORMATS.items() if element.whole_vector
)
SCALE_DTYPES: tuple[str, ...] = tuple(SCALE_FORMATS)
ROTATION_NAMES: tuple[str, ...] = tuple(ROTATIONS)
NO_ROTATION = "none"
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)
# Tokens pooled into one CSA summary: a power of two, at most block_size (rules.py).
CSA_RATIOS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
K_SCALE_AXES: tuple[str, ...] = ("token", "channel")
PER_TENSOR = "tensor"
# What the boundary layers cache (boundary_layers).
BOUNDARY_PAIR = ("fp16", "fp16")
# How keys are pooled into a CSA summary: turned to the group's centre first (pre_rope, as if
# pooled before RoPE; kvtune/kernels/cache/rope_align.py), or averaged as cached (post_rope, the
# old way); none: no summaries, an older block a query does not select is skipped (Quest).
NO_SUMMARY = "none"
CSA_SUMMARIES: tuple[str, ...] = ("pre_rope", "post_rope", NO_SUMMARY)
# What scores older blocks for selection: Quest-style per-channel key bounds of each block (one
# slot a block: the max in K, the min in V), the mean of its cached keys (one K slot a block;
# q.mean is the block's mean logit, which dilutes the one token retrieval needs), or its
# summaries (no extra bytes, but a mean dilutes that token too).
CSA_INDEXES: tuple[str, ...] = ("bounds", "means", "summaries")
# The indexes kept one slot a block in an index pool of their own (written as blocks leave the
# window), which let selection run without summaries.
POOLED_INDEXES: tuple[str, ...] = ("bounds", "means")
# Where key bounds are kept: auto, in the layer's own K and V formats and its rotated space; or a
# separate index pool in the model's own basis (where RoPE's outlier channels make Quest's bound
# sharp) in one of these dtypes, whatever the layer's formats (so per-channel keys, which are
# quantized a whole block at a time, can sit beside selection).
INDEX_IN_LAYER_FORMAT = "auto"
# A quantized separate index keeps groups of INDEX_GROUP channels with fp16 scales (bounds in
# the model's basis keep RoPE's outlier channels, which one scale a vector would flatten), so
# any policy dtype whose codes take such groups can hold it.
INDEX_GROUP = 32
INDEX_SCALE_DTYPE = "fp16"
CSA_INDEX_DTYPES: tuple[str, ...] = (
    INDEX_IN_LAYER_FORMAT,
    *(
        name
        for name in KV_DTYPES
        if name != AUTO
        and not ELEMENT_FORMATS[name].whole_vector
        and ELEMENT_FORMATS[name].scale_dtype in (None, INDEX_SCALE_DTYPE)
    ),
)
# Where decode puts the blocks it fetches from the host tier: resident (each layer keeps its own
# staging blocks, so a block chosen again next step is not fetched again) or streamed (one
# staging pool shared by the layers in turn, as ShadowKV and InfiniGen fetch a layer at a time:
# a layer's selection is fetched every step, for 1 / num_layers of the device bytes).
RESIDENT_STAGING = "resident"
CSA_STAGINGS: tuple[str, ...] = (RESIDENT_STAGING, "streamed")
# Older blocks are kept by importance in groups of this many consecutive blocks: csa_keep of
# each group stays exact, decided when the group's first block leaves the window.
KEEP_GROUP = 8
KEEP_FRACTIONS: tuple[float, ...] = tuple(i / KEEP_GROUP for i in range(KEEP_GROUP))
