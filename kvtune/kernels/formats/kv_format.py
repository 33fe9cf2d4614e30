"""How one cached K or V stream is stored: element dtype, scale grouping and scale dtype.

Pools, kernels and the byte arithmetic of the planner all derive sizes from this one class, so
the bytes the runtime allocates and the bytes the planner predicts cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS, ElementFormat
from kvtune.kernels.formats.scale_formats import SCALE_FORMATS, ScaleFormat

QUANTIZED_DTYPES: tuple[str, ...] = tuple(
    name for name, element in ELEMENT_FORMATS.items() if element.quantized
)
ELEMENT_BITS: dict[str, int] = {name: element.bits for name, element in ELEMENT_FORMATS.items()}
# The unquantized formats' torch dtypes: the compute dtypes a model runs in.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: element.torch_dtype for name, element in ELEMENT_FORMATS.items() if not element.quantized
}
SCALE_BYTES: dict[str, int] = {name: scale.nbytes for name, scale in SCALE_FORMATS.items()}
# Scale dtypes that can hold a zero point (an E4M3 code has no room for a signed offset).
ZERO_POINT_SCALE_DTYPES: tuple[str, ...] = tuple(
    name for name, scale in SCALE_FORMATS.items() if scale.zero_point
)
# Where a quantized stream's fp32 tensor scale comes from: measured on a calibration text
# (runtime.calibration), or 1 (what vLLM and SGLang use when the checkpoint carries no
# k_scale / v_scale).
TENSOR_SCALES: tuple[str, ...] = ("calibrated", "unit")


@dataclass(frozen=True)
class KVFormat:
    """Storage format of one K or V stream.

    dtype: a registered element format (`kvtune.kernels.formats.element_formats`): fp32, fp16 or
        bf16 (stored as is), or a quantized code such as fp8 (E4M3), fp4 (E2M1, two codes a
        byte: element 2i in the low nibble, element 2i+1 in the high nibble) or int4
        (asymmetric uniform, a scale and a zero point per group); its entry says which scale
        dtype and grouping it needs.
    group_size: elements along head_dim sharing one scale (and zero point); None means one fp32
        scale for the whole tensor (per layer and per K/V, as vLLM's fp8 cache), which the
        integer formats refuse: they need a zero point per group. Ignored when unquantized.
    scale_dtype: fp16, e4m3 (NVFP4-style: E4M3 group scales times an fp32 tensor scale), fp32
        (vLLM's per-token-head scales) or ue8m0 (powers of two, MX-style); see
        `kvtune.kernels.formats.scale_formats`. Zero points are stored in the scale dtype, so the
        integer formats need fp16.
    token_group: consecutive tokens of a block sharing each scale: 1 (per-token scales) or a
        divisor of the block size. group_size 1 with token_group = block_size is KIVI's
        per-channel key layout: one scale (and zero point) per channel per block, which follows
        the fixed outlier channels of keys instead of letting them set every token's scale. Such
        a group is quantized once all its tokens are there (a whole-block copy), never by a
        per-token write.

    Stored per vector: codes, then the scales buffer holds the group scales [groups] followed,
    for formats with a zero point, by the group zero points [groups]; with token_group > 1 one
    such row serves token_group consecutive slots.
    """

    dtype: str
    group_size: int | None = None
    scale_dtype: str = "fp16"
    token_group: int = 1
    tensor_scale: str = "calibrated"

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_FORMATS:
            raise ValueError(f"dtype={self.dtype!r}: allowed {list(ELEMENT_FORMATS)}")
        if self.tensor_scale not in TENSOR_SCALES:
            raise ValueError(f"tensor_scale={self.tensor_scale!r}: allowed {list(TENSOR_SCALES)}")
        if self.scale_dtype not in SCALE_BYTES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r}: allowed {sorted(SCALE_BYTES)}")
        if not self.quantized:
            object.__setattr__(self, "group_size", None)
            object.__setattr__(self, "token_group", 1)
        elif self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size={self.group_size!r}: must be a positive int or None")
        elif self.group_size is None and (
            self.zero_point or self.element.alt_max_code or self.element.scale_dtype
        ):
            raise ValueError(
                f"group_size=None: {self.dtype} needs a group size (it keeps a zero point, a "
                "chosen scale or a scale word per group)"
            )
        if not isinstance(self.token_group, int) or self.token_group < 1:
            raise ValueError(f"token_group={self.token_group!r}: must be a positive int")
        if self.token_group > 1 and self.quantized and self.element.whole_vector:
            raise ValueError(
                f"token_group={self.token_group}: {self.dtype} codes whole vectors; allowed [1]"
            )
        if self.token_group > 1 and self.group_size is None:
            raise ValueError(
                f"token_group={self.token_group}: needs group scales (a quantized format with a "
                "group_size)"
            )
        needed = self.element.scale_dtype if self.quantized else None
        if needed is not None and self.scale_dtype != needed:
            raise ValueError(
                f"scale_dtype={self.scale_dtype!r}: {self.dtype} stores its group scales as "
                f"{needed}; allowed ['{needed}']"
            )
        if self.zero_point and self.scale_dtype not in ZERO_POINT_SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype={self.scale_dtype!r}: {self.dtype} stores zero points in the scale "
                f"dtype; allowed {list(ZERO_POINT_SCALE_DTYPES)}"
            )

    @property
    def quantized(self) -> bool:
        return self.element.quantized

    @property
    def element(self) -> ElementFormat:
        """The registered element format."""
        return ELEMENT_FORMATS[self.dtype]

    @property
    def zero_point(self) -> bool:
        """Whether each group stores a zero point beside its scale (asymmetric formats)."""
        return self.quantized and self.element.zero_point

    @property
    def max_code(self) -> float:
        """Largest code magnitude: 448 for E4M3, 6 for E2M1, 2^bits - 1 for the int formats."""
        return self.element.max_code

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if this format cannot store vectors of head_dim elements."""
        chunk = self.element.chunk
        if head_dim % chunk:
            raise ValueError(
                f"head_dim={head_dim}: {self.dtype} packs {chunk} codes into whole bytes, "
                f"needs a multiple of {chunk}"
            )
        if self.group_size is not None and head_dim % self.group_size:
            raise ValueError(f"group_size={self.group_size}: must divide head_dim={head_dim}")
        if self.quantized and self.element.whole_vector and self.group_size != head_dim:
            raise ValueError(
                f"group_size={self.group_size}: {self.dtype} codes a whole vector, needs "
                f"group_size=head_dim={head_dim}"
            )

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of element codes for one vector of head_dim elements."""
        return head_dim * self.element.bits // 8

    def scales_per_vector(self, head_dim: int) -> int:
        """Entries of the scales buffer for one vector: its group scales, and as many zero points
        for asymmetric formats (0 for per-tensor or unquantized)."""
        if self.group_size is None:
            return 0
        return head_dim // self.group_size * (2 if self.zero_point else 1)

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes one cached vector (one token, one head) costs: codes plus its group scales and
        zero points. Only per-token scales give every vector its own bytes (see block_bytes)."""
        if self.token_group > 1:
            raise ValueError(
                f"token_group={self.token_group}: scales are shared by tokens, use block_bytes"
            )
        return self.block_bytes(head_dim, 1)

    def check_block_size(self, block_size: int) -> None:
        """Raise if a block of block_size tokens does not split into whole token groups."""
        if block_size % self.token_group:
            raise ValueError(f"token_group={self.token_group}: must divide block_size={block_size}")

    def block_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes one block of block_size vectors (one head) costs: codes plus the scales and
        zero points of its token groups."""
        self.check_head_dim(head_dim)
        self.check_block_size(block_size)
        scale_rows = block_size // self.token_group
        scale_bytes = self.scales_per_vector(head_dim) * SCALE_BYTES[self.scale_dtype]
        return block_size * self.code_bytes(head_dim) + scale_rows * scale_bytes

    @property
    def code_torch_dtype(self) -> torch.dtype:
        return self.element.torch_dtype

    @property
    def scale_format(self) -> ScaleFormat:
        """The registered group-scale dtype."""
        return SCALE_FORMATS[self.scale_dtype]

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return self.scale_format.torch_dtype

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Allocate a paged pool: codes [blocks, block_size, heads, code width] and scales
        [blocks, block_size / token_group, heads, scales_per_vector] (None when the format
        keeps none)."""
        self.check_head_dim(head_dim)
        self.check_block_size(block_size)
        width = head_dim if not self.quantized else self.code_bytes(head_dim)
        codes = torch.zeros(
            num_blocks, block_size, num_heads, width, dtype=self.code_torch_dtype, device=device
        )
        groups = self.scales_per_vector(head_dim)
        if groups == 0:
            return codes, None
        scales = torch.zeros(
            num_blocks,
            block_size // self.token_group,
            num_heads,
            groups,
            dtype=self.scale_torch_dtype,
            device=device,
        )
        return codes, scales
