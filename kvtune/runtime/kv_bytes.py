"""KV-cache byte arithmetic: one sequence's blocks in each pool, and one block's bytes.

The block manager holds exactly the layout below, kvtune/runtime/pool_plan.py sizes the
engine's pools from it, and the planner and the tuner report its per-sequence bytes, so none
of them can disagree. Units: bytes and tokens.

Physical layout of one sequence of T tokens (DESIGN.md sections 1 and 3):
- without compression (csa_ratio 1): one exact stream of T tokens;
- with compression: a sink stream (positions [0, S)), a window stream (the rest, minus the
  blocks already compressed) and a summary stream. A whole window block is pooled into
  block_size / r summaries once all its tokens are older than the W most recent ones, so the
  window holds between W and W + block_size - 1 tokens once T - S > W.
Each stream is rounded up to whole blocks. With recent_unquantized = R > 0, a block of an exact
stream stays in fp16 while it holds any of the last R tokens; older blocks use the layer's
format. With per-channel key scales (k_scale_axis=channel) a block is quantized once full, so the
partial last block of the growing stream stays in fp16 too. Summaries always use the layer's
format. Formats whose scales are shared by the tokens of a block cost bytes per block, so every
total here is counted in blocks.
With selection (csa_topk > 0, csa_host) every pooled block keeps its exact copy in the host
tier (the layer's format), and the device holds a staging pool of min(csa_topk, pooled blocks)
blocks a sequence into which selected blocks are fetched: device bytes count the staging pool,
host bytes the tier. Per-layer budgets (layer_csa_topk) share that pool: it follows the largest
budget (csa_topk), each layer reading its first min(budget, pooled blocks) staging blocks.
The staging pool is resident (every layer's own blocks, in the main pool) or,
with csa_staging = streamed, one pool the layers fill in turn: its blocks cost one block of each
distinct layer format, not of every layer. With csa_index = bounds each pooled block also keeps
one device slot of key bounds (max in K, min in V), with csa_index = means one K slot of its
mean key (no V half), packed block_size to a block of the index pool: in the layer's formats
(csa_index_dtype auto) or in the index dtype. A layer whose budget is 0 never reads an older
block exactly, so it keeps neither host copies nor an index. Without summaries (csa_summary
none) the summary stream is empty.
With importance keeping (csa_keep) a sequence holds csa_keep * KEEP_GROUP device blocks for every
group of KEEP_GROUP pooled blocks, counted from the group's first: each layer and KV head copies
into them the group's blocks that received the most attention (their summaries stay too).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.policy import INDEX_GROUP, KEEP_GROUP, KVPolicy
from kvtune.runtime.pool_kinds import DEVICE_KINDS, HOST, INDEX, MAIN, RECENT, STAGE

RECENT_DTYPE = "fp16"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StreamExtent:
    """Tokens [start, start + length) of a sequence stored contiguously in one paged stream."""

    start: int
    length: int


@dataclass(frozen=True)
class SequenceBlocks:
    """Blocks one sequence holds in every layer, by storage class."""

    quantized: int
    recent: int
    summary: int
    staging: int = 0
    streamed: int = 0
    host: int = 0
    index: int = 0
    kept: int = 0

    @property
    def main(self) -> int:
        """Device blocks in the layer's format: exact, summaries, the staging pool and
        importance-kept blocks."""
        return self.quantized + self.summary + self.staging + self.kept

    @property
    def total(self) -> int:
        """Device blocks of every kind."""
        return self.main + self.recent + self.index + self.streamed

    def by_pool(self) -> dict[str, int]:
        """Blocks held in each pool (pool_kinds)."""
        return {
            MAIN: self.main,
            RECENT: self.recent,
            INDEX: self.index,
            STAGE: self.streamed,
            HOST: self.host,
        }


def exact_extents(policy: KVPolicy, num_tokens: int) -> list[StreamExtent]:
    """The exact (uncompressed) streams of a sequence of num_tokens tokens."""
    if not policy.compressed:
        return [StreamExtent(0, num_tokens)]
    sinks = min(policy.csa_sinks, num_tokens)
    window_start = sinks + compressed_blocks(policy, num_tokens) * policy.block_size
    return [StreamExtent(0, sinks), StreamExtent(window_start, num_tokens - window_start)]


def compressed_blocks(policy: KVPolicy, num_tokens: int) -> int:
    """Window blocks already pooled into summaries for a sequence of num_tokens tokens."""
    if not policy.compressed:
        return 0
    after_sinks = max(0, num_tokens - policy.csa_sinks)
    return max(0, after_sinks - policy.csa_window) // policy.block_size


def kept_blocks(policy: KVPolicy, num_tokens: int) -> int:
    """Device blocks holding importance-kept copies: csa_keep of each group of KEEP_GROUP pooled
    blocks, held from the moment the group's first block is pooled."""
    groups = ceil_div(compressed_blocks(policy, num_tokens), KEEP_GROUP)
    return groups * policy.kept_per_group


def summary_tokens(policy: KVPolicy, num_tokens: int) -> int:
    if not policy.summarises:
        return 0
    return compressed_blocks(policy, num_tokens) * policy.block_size // policy.csa_ratio


def recent_blocks_of(
    extent: StreamExtent, block_size: int, num_tokens: int, recent: int, growing: bool
) -> int:
    """Blocks of an exact stream kept in fp16: those that end after the first of the last
    `recent` tokens. A block of the growing (last) stream ends at its block boundary, so its
    partial last block is always kept; a complete stream's last block ends with the stream."""
    blocks = ceil_div(extent.length, block_size)
    if blocks == 0:
        return 0
    older_than_recent = num_tokens - recent - extent.start
    full_blocks_recent = max(0, (blocks - 1) - max(0, older_than_recent // block_size))
    last_block_end = blocks * block_size if growing else extent.length
    return full_blocks_recent + int(last_block_end > older_than_recent)


def sequence_blocks(policy: KVPolicy, num_tokens: int) -> SequenceBlocks:
    """Blocks per layer a sequence of num_tokens tokens occupies under the policy."""
    bs = policy.block_size
    quantized = recent = 0
    extents = exact_extents(policy, num_tokens)
    for index, extent in enumerate(extents):
        in_recent = 0
        if policy.recent_tail:
            # The window grows; the sink stream grows only until it holds its csa_sinks tokens.
            growing = index == len(extents) - 1 or extent.length < policy.csa_sinks
            in_recent = recent_blocks_of(extent, bs, num_tokens, policy.recent_unquantized, growing)
        recent += in_recent
        quantized += ceil_div(extent.length, bs) - in_recent
    summary = ceil_div(summary_tokens(policy, num_tokens), bs)
    host = compressed_blocks(policy, num_tokens) if policy.selects else 0
    staging = min(policy.csa_topk, host)
    return SequenceBlocks(
        quantized=quantized,
        recent=recent,
        summary=summary,
        staging=0 if policy.streams_staging else staging,
        streamed=staging if policy.streams_staging else 0,
        host=host,
        index=ceil_div(host, bs) if policy.pooled_index else 0,
        kept=kept_blocks(policy, num_tokens),
    )


@dataclass(frozen=True)
class LayerFormats:
    """Storage formats of one layer: K and V in the layer's dtypes, the fp16 recent region, and
    the index pool (bounds: max in k_index, min in v_index; means: the mean in k_index, and
    v_index None: no V half)."""

    k: KVFormat
    v: KVFormat
    k_recent: KVFormat
    v_recent: KVFormat
    k_index: KVFormat
    v_index: KVFormat | None


def _recent_format(fmt: KVFormat) -> KVFormat:
    return KVFormat(RECENT_DTYPE) if fmt.quantized else fmt


def index_format(dtype: str) -> KVFormat:
    """The format of a separate key-bounds index in `dtype` (fp16 plain; quantized dtypes in
    groups of INDEX_GROUP channels with fp16 scales)."""
    if dtype == RECENT_DTYPE:
        return KVFormat(dtype)
    return KVFormat(dtype, INDEX_GROUP, "fp16")


def layer_formats(arch: ModelArch, policy: KVPolicy) -> list[LayerFormats]:
    """Per-layer storage formats; validates the policy against the model first."""
    policy.check_model(arch)
    formats = []
    for k_dtype, v_dtype in policy.layer_pairs(arch.num_layers):
        k = policy.kv_format(k_dtype, arch.dtype, keys=True)
        v = policy.kv_format(v_dtype, arch.dtype)
        k_index, v_index = k, v
        if policy.separate_index:
            k_index = v_index = index_format(policy.csa_index_dtype)
        if policy.csa_index == "means":
            v_index = None
        formats.append(LayerFormats(k, v, _recent_format(k), _recent_format(v), k_index, v_index))
    return formats


def layer_block_bytes(arch: ModelArch, k: KVFormat, v: KVFormat | None, block_size: int) -> int:
    """Bytes one block of block_size tokens costs in one layer with K in format k and V in v
    (None: a pool without a V half)."""
    size = arch.cached_vector_size
    if arch.is_mla:
        return k.block_bytes(size, block_size)
    v_bytes = 0 if v is None else v.block_bytes(size, block_size)
    return arch.cached_heads * (k.block_bytes(size, block_size) + v_bytes)


def kv_bytes_per_token(arch: ModelArch, policy: KVPolicy) -> int:
    """Bytes one token adds at full fidelity under the policy's dtypes, summed over layers
    (rounded up where a block's tokens share scales)."""
    bs = policy.block_size
    total = sum(layer_block_bytes(arch, f.k, f.v, bs) for f in layer_formats(arch, policy))
    return ceil_div(total, bs)


def selecting_layers(arch: ModelArch, policy: KVPolicy) -> list[bool]:
    """Per layer, whether it reads selected older blocks (a budget above 0): only those keep
    host-tier copies and an index."""
    return [topk > 0 for topk in policy.layer_topk(arch.num_layers)]


def block_bytes(arch: ModelArch, policy: KVPolicy) -> dict[str, int]:
    """Bytes one block id of each pool costs across all layers (pool_kinds): the layers'
    formats in the main pool, fp16 in the recent one, the index and the host tier only in the
    layers that select, and in a streamed staging pool one block of each distinct layer format
    (layers of one format fill the same pool in turn)."""
    bs = policy.block_size
    formats = layer_formats(arch, policy)
    selecting = [f for f, s in zip(formats, selecting_layers(arch, policy), strict=True) if s]
    return {
        MAIN: sum(layer_block_bytes(arch, f.k, f.v, bs) for f in formats),
        RECENT: sum(layer_block_bytes(arch, f.k_recent, f.v_recent, bs) for f in formats),
        INDEX: sum(layer_block_bytes(arch, f.k_index, f.v_index, bs) for f in selecting),
        STAGE: sum(layer_block_bytes(arch, k, v, bs) for k, v in {(f.k, f.v) for f in formats}),
        HOST: sum(layer_block_bytes(arch, f.k, f.v, bs) for f in selecting),
    }


def kv_bytes_per_sequence(arch: ModelArch, policy: KVPolicy, num_tokens: int) -> int:
    """Device bytes the paged cache holds for one sequence of num_tokens tokens, all layers
    (the staging pool included, the host tier not)."""
    held = sequence_blocks(policy, num_tokens).by_pool()
    sizes = block_bytes(arch, policy)
    return sum(held[kind] * sizes[kind] for kind in DEVICE_KINDS)


def host_kv_bytes_per_sequence(arch: ModelArch, policy: KVPolicy, num_tokens: int) -> int:
    """Host-tier bytes of one sequence of num_tokens tokens, all layers (0 without one)."""
    return sequence_blocks(policy, num_tokens).host * block_bytes(arch, policy)[HOST]


def max_fetch_bytes_per_step(arch: ModelArch, policy: KVPolicy, num_tokens: int) -> int:
    """Most bytes one decode step of a num_tokens sequence fetches from the host tier: every
    layer refills the staging blocks its budget uses, min(its csa_topk, older blocks) (what a
    streamed staging pool fetches every step; a resident one fetches nothing for a choice
    that stays)."""
    host = sequence_blocks(policy, num_tokens).host
    bs = policy.block_size
    return sum(
        min(topk, host) * layer_block_bytes(arch, f.k, f.v, bs)
        for topk, f in zip(
            policy.layer_topk(arch.num_layers), layer_formats(arch, policy), strict=True
        )
    )
