"""A paged K or V pool (codes, group scales, format, tensor scale) and torch reference reads and
writes of its vectors by slot.

Slots address token positions in the pool: slot = block_id * block_size + offset, so the
vector of (slot, head) is codes.flatten(0, 1)[slot, head]. Kernels read and write pools through
`kvtune.kernels.formats.quantize.load_dequant_tile` / `quantize_store_tile` with rows = slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtune.kernels.formats.directed_rounding import ROUND_NEAREST, quantize_rounded_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import (
    check_kernel_format,
    code_width,
    dequantize_ref,
    tensor_scale_or_one,
)
from kvtune.kernels.native.copy_rows import copy_head_rows_native
from kvtune.kernels.native.read_blocks import read_blocks_native


@dataclass(frozen=True)
class KVPool:
    """One paged K or V pool, as `KVFormat.allocate` lays it out.

    codes: [num_blocks, block_size, num_heads, width] in fmt's code dtype (width = head_dim for
        fp32/fp16/bf16, else head_dim * bits / 8 code bytes: fp8/int8 one a code, fp4/int4 two
        codes a byte, int2 four).
    scales: [num_blocks, block_size / fmt.token_group, num_heads, fmt.scales_per_vector] fp16
        or uint8 E4M3 group scales (followed by the group zero points for the integer formats),
        or None when fmt keeps none.
    tensor_scale: positive fp32 one-element tensor multiplying every dequantized value of a
        quantized format (see `kvtune.kernels.formats.quantize`); None means 1.
    """

    codes: torch.Tensor
    scales: torch.Tensor | None
    fmt: KVFormat
    tensor_scale: torch.Tensor | None = None
    # Built with no tensor scale (1): a reader may skip the multiply, which is exact either way.
    unit_tensor_scale: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        codes = self.codes
        if codes.dim() != 4 or not codes.is_contiguous():
            raise ValueError(f"codes.shape={tuple(codes.shape)}: must be contiguous 4-D")
        head_dim = self.head_dim
        check_kernel_format(self.fmt, head_dim)
        if codes.dtype != self.fmt.code_torch_dtype or codes.shape[3] != code_width(
            self.fmt, head_dim
        ):
            raise ValueError(f"codes: dtype {codes.dtype} does not store {self.fmt}")
        self.fmt.check_block_size(codes.shape[1])
        groups = self.fmt.scales_per_vector(head_dim)
        rows = codes.shape[1] // self.fmt.token_group
        expected = (codes.shape[0], rows, codes.shape[2], groups)
        if groups == 0 and self.scales is not None:
            raise ValueError(f"scales: must be None for {self.fmt}")
        if groups and (self.scales is None or tuple(self.scales.shape) != expected):
            raise ValueError(f"scales: must have shape {expected} for {self.fmt}")
        if groups and (
            self.scales.dtype != self.fmt.scale_torch_dtype or not self.scales.is_contiguous()
        ):
            raise ValueError(f"scales: must be contiguous {self.fmt.scale_torch_dtype}")
        object.__setattr__(self, "unit_tensor_scale", self.tensor_scale is None)
        object.__setattr__(
            self, "tensor_scale", tensor_scale_or_one(self.tensor_scale, codes.device)
        )

    @classmethod
    def allocate(
        cls,
        fmt: KVFormat,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        tensor_scale: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        """A zero-filled pool of num_blocks blocks of block_size tokens."""
        codes, scales = fmt.allocate(num_blocks, block_size, num_heads, head_dim, device)
        return cls(codes, scales, fmt, tensor_scale)

    @property
    def num_slots(self) -> int:
        return self.codes.shape[0] * self.codes.shape[1]

    @property
    def block_size(self) -> int:
        return self.codes.shape[1]

    @property
    def num_heads(self) -> int:
        return self.codes.shape[2]

    @property
    def head_dim(self) -> int:
        width = self.codes.shape[3]
        return width * 8 // self.fmt.element.bits if self.fmt.quantized else width


def read_vectors_ref(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    """fp32 vectors [len(slots), num_heads, head_dim] stored at slots (readable, slow)."""
    slots = slots.long()
    codes = pool.codes.flatten(0, 1)[slots]
    scales = None
    if pool.scales is not None:
        scales = pool.scales.flatten(0, 1)[slots // pool.fmt.token_group]
    return dequantize_ref(codes, scales, pool.fmt, pool.tensor_scale, pool.head_dim)


def read_blocks_ref(pool: KVPool, table: torch.Tensor) -> torch.Tensor:
    """fp32 vectors [S, blocks * block_size, num_heads, head_dim] of the blocks table [S, blocks]
    lists (valid block ids), in order. Gathers whole blocks (a contiguous copy each), far
    cheaper than slots."""
    codes = gather_blocks(pool.codes, table)  # [S, blocks, block_size, heads, width]
    scales = None if pool.scales is None else gather_blocks(pool.scales, table)
    rows = pool.fmt.token_group
    if rows > 1:  # a scale row serves `rows` consecutive tokens: broadcast it, not repeat it
        codes = codes.unflatten(2, (-1, rows))
        scales = scales.unsqueeze(3)
    tensor_scale = None if pool.unit_tensor_scale else pool.tensor_scale
    values = dequantize_ref(codes, scales, pool.fmt, tensor_scale, pool.head_dim)
    return values.flatten(1, values.dim() - 3)


def _scaled_codes(pool: KVPool) -> bool:
    """Whether pool stores element code * group scale (+ zero point), which
    `read_blocks_into` decodes itself (formats without affine_decode decode otherwise:
    `kvtune.kernels.formats.quantize.dequantize_ref`)."""
    return pool.scales is not None and pool.fmt.element.affine_decode


def read_blocks_into(pool: KVPool, table: torch.Tensor, out: torch.Tensor) -> None:
    """The vectors of the blocks table [S, blocks] lists (on the pool's device; a negative id,
    padding, leaves its rows undefined), dequantized into out, fp32 [S, H, blocks * block_size,
    D] on the reading device: the layout attention and index products read, where
    `read_blocks_ref` gives [S, T, H, D]. out may be a slice of a larger buffer along tokens or
    channels. Group-scaled codes on a CPU are read by one C call (`kvtune.kernels.native`);
    elsewhere they are decoded here: the codes, then one multiply by the scales and one add of
    the zero points, the scales broadcast along a leading dimension (torch's broadcast along the
    innermost one ran several times slower); other codes through `dequantize_ref`. A host-tier
    pool elsewhere is gathered where it lives and moved as codes."""
    device, fmt, scaled = out.device, pool.fmt, _scaled_codes(pool)
    if scaled and read_blocks_native(pool, table, out):
        return
    table = table.clamp(min=0)
    codes = gather_blocks(pool.codes, table).to(device)  # [S, blocks, block_size, H, width]
    by_block = codes.permute(0, 3, 1, 2, 4)  # [S, H, blocks, block_size, width]
    if not fmt.quantized:  # fp16, bf16, fp32: the codes are the values
        out.view(by_block.shape).copy_(by_block)
        return
    if not scaled:
        out.copy_(read_blocks_ref(pool, table).to(device).transpose(1, 2))
        return
    seqs, heads, tokens, head_dim = out.shape
    rows, groups = fmt.token_group, head_dim // fmt.group_size
    numbers = fmt.element.decode(by_block)  # [S, H, blocks, block_size, D]
    stored = gather_blocks(pool.scales, table).to(device)  # [S, blocks, bs / rows, H, W]
    scales = fmt.scale_format.decode(stored).permute(0, 3, 1, 2, 4)  # [S, H, blocks, bs/rows, W]
    if not pool.unit_tensor_scale:
        scales = scales * pool.tensor_scale.to(device)
    # Vectors as [S, H, token groups, (rows,) (groups, channels a group) or channels], and the
    # scales broadcast over rows and channels: the fewest dimensions the product needs (one
    # scale a channel or one a vector needs no split).
    leading = [seqs, heads, tokens // rows] + ([rows] if rows > 1 else [])
    split = 1 < groups < head_dim
    channels = [groups, head_dim // groups] if split else [head_dim]
    per_group = [seqs, heads, tokens // rows] + ([1] if rows > 1 else [])
    per_group += [groups, 1] if split else [groups]
    target = out.view(*leading, *channels)
    torch.mul(
        numbers.view(*leading, *channels), scales[..., :groups].reshape(per_group), out=target
    )
    if fmt.zero_point:
        target.add_(scales[..., groups:].reshape(per_group))


def gather_blocks(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """blocks[table] ([*table.shape, *blocks.shape[1:]]) by index_select, which copies whole
    blocks: 4x faster than advanced indexing on a CPU for a decode step's hundred blocks. It
    takes int32 ids as they are (a conversion a gather was a tenth of a decode step's ops)."""
    rows = blocks.index_select(0, table.flatten())
    return rows.view(*table.shape, *blocks.shape[1:])


def write_vectors_ref(
    pool: KVPool, slots: torch.Tensor, vectors: torch.Tensor, rounding: str = ROUND_NEAREST
) -> None:
    """Quantize vectors [len(slots), num_heads, head_dim] into pool at slots; slot < 0 skips.
    A token-grouped pool takes whole token groups: slots in runs of token_group consecutive
    slots, each run starting at a multiple of token_group. rounding: to nearest, or up / down
    (values read back >= / <= the vectors: `kvtune.kernels.formats.directed_rounding`)."""
    keep = slots >= 0
    slots = slots[keep].long()
    rows = pool.fmt.token_group
    if rows > 1 and not _whole_token_groups(slots, rows):
        raise ValueError(f"slots: {pool.fmt} needs whole, aligned runs of {rows} slots")
    codes, scales = quantize_rounded_ref(vectors[keep], pool.fmt, pool.tensor_scale, rounding)
    pool.codes.flatten(0, 1)[slots] = codes
    if scales is not None:
        pool.scales.flatten(0, 1)[slots[::rows] // rows] = scales


def _whole_token_groups(slots: torch.Tensor, rows: int) -> bool:
    """Whether slots are runs of `rows` consecutive slots, each starting at a multiple of rows."""
    if len(slots) % rows:
        return False
    runs = slots.unflatten(0, (-1, rows))
    consecutive = runs == runs[:, :1] + torch.arange(rows, device=slots.device)
    return bool(consecutive.all() and (runs[:, 0] % rows == 0).all())


def _same_tensor_scale(a: KVPool, b: KVPool) -> bool:
    """Whether two pools' tensor scales are equal: at once when both were built without one (1)
    or they share one storage, else by value (a decode step fetches in every layer, where
    comparing values cost a third of a small fetch)."""
    if a.unit_tensor_scale and b.unit_tensor_scale:
        return True
    same_storage = (
        a.tensor_scale.device == b.tensor_scale.device
        and a.tensor_scale.data_ptr() == b.tensor_scale.data_ptr()
    )
    return same_storage or torch.equal(a.tensor_scale.cpu(), b.tensor_scale.cpu())


def copy_blocks(
    src: KVPool,
    src_blocks: torch.Tensor,
    dst: KVPool,
    dst_blocks: torch.Tensor,
    heads: torch.Tensor | None = None,
) -> None:
    """Copy blocks, codes and scales as they are, between two pools of one format that may
    live on different devices (the host tier and the device): no rounding happens. heads:
    copy only head heads[i] of each pair of blocks (the slices a KV head selected), else whole
    blocks."""
    if src.fmt != dst.fmt or src.codes.shape[1:] != dst.codes.shape[1:]:
        raise ValueError(f"copy_blocks: pools differ ({src.fmt} and {dst.fmt})")
    if src.fmt.quantized and not _same_tensor_scale(src, dst):
        raise ValueError("copy_blocks: pools differ in tensor scale")
    # A pool's codes and scales share its device: index once per side, not per tensor.
    read = src_blocks.long().to(src.codes.device)
    write = dst_blocks.long().to(dst.codes.device)
    read_heads = write_heads = None
    if heads is not None:
        read_heads = heads.long().to(src.codes.device)
        write_heads = heads.long().to(dst.codes.device)
    pairs = [(src.codes, dst.codes)]
    if src.scales is not None:
        pairs.append((src.scales, dst.scales))
    if heads is None:
        for source, target in pairs:
            target[write] = source[read].to(target.device, non_blocking=True)
        return
    if copy_head_rows_native(pairs, read, write, read_heads):
        return
    # A head's slice of a block is a row of bytes per token row: gathered and scattered as
    # whole rows of the [slots * heads, width] view (indexing blocks and heads at once copied
    # it byte by byte, most of a batch's fetch).
    for source, target in pairs:
        slices = source.flatten(0, 2).index_select(0, _head_rows(read, read_heads, source))
        target.flatten(0, 2).index_copy_(
            0, _head_rows(write, write_heads, target), slices.to(target.device)
        )


def _head_rows(blocks: torch.Tensor, heads: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Rows of tensor [blocks, rows, num_heads, width] viewed as [-1, width] that hold head
    heads[i] of block blocks[i], block after block, row after row."""
    _, rows, num_heads, _ = tensor.shape
    offsets = torch.arange(0, rows * num_heads, num_heads, device=blocks.device)
    return ((blocks * (rows * num_heads) + heads)[:, None] + offsets).flatten()
