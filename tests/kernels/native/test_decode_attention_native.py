"""The fused CPU decode kernel (kvtune/kernels/native/decode_attention.c) against SDPA over the
vectors the torch reference reader (`read_blocks_ref`) returns, and against the torch decode
path, within the decode contract's 1e-5 relative error: for every registered element format on
K and on V (listed from the registry), the scale layouts formats take (per token, per channel
over a block, token pairs; fp16, fp32, E4M3 and UE8M0 scales; one tensor scale), several
streams of unequal lengths with their own logit biases, per-KV-head query masks, GQA 9/3 and
head_dim 64, in pools whose unread slots decode to NaN. A rotated cache reaches the kernel as
any other stored vectors (queries are rotated before attention and outputs after), so its
values need no case of their own. A sequence's output has the same bits in any batch; formats
the kernel's decoder lacks (decodes other than code x scale + zero) fall back to the torch
path."""

import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.attention.decode_torch import decode_attention_torch
from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from kvtune.kernels.cache.pool import KVPool, read_blocks_ref, write_vectors_ref
from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.native import build, pool_codes
from kvtune.kernels.native.decode_attention import SOURCE, decode_attention_native
from tests.kernels.attention.test_attention import TOLERANCE, relative_error

BLOCK, HEADS, GROUP, DIM = 16, 3, 3, 64
SCALE = DIM**-0.5


def _registry_format(name: str) -> KVFormat:
    """A format storing the registered element `name`: groups of 32 (whole vectors where the
    element codes them), in the scale dtype it needs."""
    element = ELEMENT_FORMATS[name]
    if not element.quantized:
        return KVFormat(name)
    return KVFormat(name, DIM if element.whole_vector else 32, element.scale_dtype or "fp16")


FORMATS = {
    **{name: _registry_format(name) for name in ELEMENT_FORMATS},
    "int4_channel": KVFormat("int4", 1, "fp16", token_group=BLOCK),
    "int2_g2_channel": KVFormat("int2", 2, "fp16", token_group=BLOCK),
    "fp4_g16_token_pairs": KVFormat("fp4", 16, "fp16", token_group=2),
    "int4_g64_unit": KVFormat("int4", 64, tensor_scale="unit"),
    "nvfp4": KVFormat("fp4", 16, "e4m3"),
    "mxfp4": KVFormat("fp4_ties_away", 32, "ue8m0"),
    "fp8_per_tensor": KVFormat("fp8"),
    "int8_symmetric_fp32": KVFormat("int8_symmetric", 64, "fp32"),
}
# No compiler here, or the kernels turned off (KVTUNE_NATIVE=0): the tests that need them skip.
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None or not build.native_enabled(SOURCE.stem),
    reason="no C compiler, or native kernels off: the torch path runs instead",
)


def _served(fmt: KVFormat) -> bool:
    """Whether the kernel's decoder serves fmt: unquantized, or codes of any width decoded as
    code x group scale (+ zero point)."""
    return not fmt.quantized or fmt.element.affine_decode


def _poisoned_pool(fmt: KVFormat, num_blocks: int) -> KVPool:
    """A pool whose every slot decodes to NaN (where fmt can: per-tensor fp4 codes cannot):
    NaN values, codes and scales, 0xFF being NaN in E4M3 and UE8M0; a tensor scale of 0.5
    where fmt calibrates one."""
    tensor_scale = (
        torch.tensor([0.5]) if fmt.quantized and fmt.tensor_scale == "calibrated" else None
    )
    pool = KVPool.allocate(fmt, num_blocks, BLOCK, HEADS, DIM, tensor_scale)
    pool.codes.fill_(0xFF if fmt.quantized else math.nan)
    if pool.scales is not None:
        pool.scales.fill_(0xFF if pool.scales.dtype == torch.uint8 else math.nan)
    return pool


def _stream(
    k_fmt: KVFormat, v_fmt: KVFormat, lengths: list[int], seed: int, logit_bias: float = 0.0
) -> PagedStream:
    """Random vectors in shuffled blocks of pools whose other slots decode to NaN, lengths
    rounded up to whole token groups, a padded block table."""
    generator = torch.Generator().manual_seed(seed)
    rows = max(k_fmt.token_group, v_fmt.token_group)
    lengths = [-(-n // rows) * rows for n in lengths]
    counts = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=generator)
    pools = [_poisoned_pool(fmt, num_blocks) for fmt in (k_fmt, v_fmt)]
    table = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        ids = order[used : used + count]
        used += count
        table[seq, :count] = ids.to(torch.int32)
        slots = ids[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
        for pool in pools:
            write_vectors_ref(pool, slots, torch.randn(length, HEADS, DIM, generator=generator))
    return PagedStream(
        pools[0],
        pools[1],
        table,
        torch.tensor(lengths, dtype=torch.int32),
        torch.zeros(len(lengths), dtype=torch.int32),
        logit_bias=logit_bias,
    )


def _oracle(q: torch.Tensor, streams: list[PagedStream]) -> torch.Tensor:
    """Per sequence: its vectors of every stream read by `read_blocks_ref`, each stream's
    logit bias and query mask as an additive mask, one SDPA; 0 for a head that sees nothing."""
    out = torch.zeros_like(q)
    for seq in range(q.shape[0]):
        keys, values, masks = [], [], []
        for stream in streams:
            length = int(stream.lengths[seq])
            if not length:
                continue
            table = stream.block_table[seq : seq + 1, : -(-length // BLOCK)]
            keys.append(read_blocks_ref(stream.k, table)[0, :length])
            values.append(read_blocks_ref(stream.v, table)[0, :length])
            shown = torch.ones(HEADS, length, dtype=torch.bool)
            if stream.query_mask is not None:  # vectors past its end are hidden
                shown[:] = False
                covered = min(length, stream.query_mask.shape[-1])
                shown[:, :covered] = stream.query_mask[seq, :, :covered]
            masks.append(torch.where(shown, stream.logit_bias, -math.inf))
        if not keys:
            continue
        mask = torch.cat(masks, -1).repeat_interleave(GROUP, dim=0)
        result = F.scaled_dot_product_attention(
            q[seq][None, :, None, :],
            torch.cat(keys).transpose(0, 1)[None],
            torch.cat(values).transpose(0, 1)[None],
            attn_mask=mask[None, :, None, :],
            scale=SCALE,
            enable_gqa=True,
        )[0, :, 0]
        out[seq] = result.nan_to_num(0.0)
    return out


def _queries(seqs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(seqs, HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(seed))
    return q, torch.arange(seqs + 1, dtype=torch.int32)


def _three_streams(k_fmt: KVFormat, v_fmt: KVFormat) -> list[PagedStream]:
    """The formats' stream (partial blocks, an empty sequence) and two biased streams of other
    formats and lengths after it."""
    return [
        _stream(k_fmt, v_fmt, [37, 0, 150, 16, 5], seed=1),
        _stream(FORMATS["fp16"], FORMATS["fp16"], [3, 4, 0, 16, 1], seed=2, logit_bias=0.7),
        _stream(FORMATS["int4_channel"], FORMATS["fp8"], [16, 32, 48, 0, 0], 3, logit_bias=-0.4),
    ]


@needs_compiler
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("name", FORMATS)
def test_every_format_matches_sdpa_and_the_torch_path(name: str, side: str) -> None:
    """The format on one side, another on the other: the fused output within 1e-5 of SDPA over
    the reference reader's vectors and of the torch decode path; a format the decoder lacks
    takes the torch path, through the backend's dispatch alike."""
    fmt, other = FORMATS[name], FORMATS["int4_g64_unit" if side == "k" else "nvfp4"]
    streams = _three_streams(*((fmt, other) if side == "k" else (other, fmt)))
    q, starts = _queries(5, seed=4)
    expected = _oracle(q, streams)
    fused = decode_attention_native(q, starts, streams, SCALE)
    through_backend = cache_attention_torch(q, None, starts, streams, SCALE)
    assert relative_error(through_backend, expected) <= TOLERANCE
    if not _served(fmt):
        assert fused is None
        return
    assert fused is not None and not fused.isnan().any()
    assert torch.equal(through_backend, fused)  # the backend dispatches decode to the kernel
    assert relative_error(fused, expected) <= TOLERANCE
    reference = decode_attention_torch(q, starts, streams, SCALE)
    assert relative_error(fused, reference) <= TOLERANCE


@needs_compiler
def test_query_masks_hide_vectors_per_kv_head() -> None:
    """Each KV head hides its own vectors of two streams (a selecting step); one head of one
    sequence sees nothing at all (output 0), a mask shorter than a stream hides the rest."""
    streams = _three_streams(FORMATS["int4_channel"], FORMATS["int4"])
    generator = torch.Generator().manual_seed(5)
    first = torch.rand(5, HEADS, 160, generator=generator) < 0.7
    second = torch.rand(5, HEADS, 10, generator=generator) < 0.5
    first[1, 2] = False
    second[1, 2] = False
    streams[0] = dataclasses.replace(streams[0], query_mask=first)
    streams[1] = dataclasses.replace(streams[1], query_mask=second)
    streams[2] = dataclasses.replace(streams[2], lengths=torch.tensor([16, 0, 48, 0, 0]).int())
    q, starts = _queries(5, seed=6)
    expected = _oracle(q, streams)
    fused = decode_attention_native(q, starts, streams, SCALE)
    assert fused is not None
    assert relative_error(fused, expected) <= TOLERANCE
    assert torch.equal(fused[1, 2 * GROUP : 3 * GROUP], torch.zeros(GROUP, DIM))
    reference = decode_attention_torch(q, starts, streams, SCALE)
    assert relative_error(fused, reference) <= TOLERANCE


def _long_streams() -> list[PagedStream]:
    lengths = [700, 1, 1500, 0, 333, 64]
    return [
        _stream(FORMATS["int4_channel"], FORMATS["int4"], lengths, seed=7),
        _stream(FORMATS["fp8"], FORMATS["fp16"], [64, 16, 0, 5, 90, 8], seed=8, logit_bias=0.3),
    ]


@needs_compiler
@pytest.mark.parametrize("split_tokens", [16, 48, 512, 1 << 20])
def test_long_sequences_in_splits_match_sdpa(split_tokens: int) -> None:
    """A sequence's vectors read in runs of split_tokens (several threads each) and merged:
    the same result as one run, within the contract."""
    streams = _long_streams()
    q, starts = _queries(6, seed=9)
    fused = decode_attention_native(q, starts, streams, SCALE, split_tokens=split_tokens)
    assert fused is not None
    assert relative_error(fused, _oracle(q, streams)) <= TOLERANCE


@needs_compiler
@pytest.mark.parametrize("split_tokens", [32, 512])
def test_a_sequences_output_has_the_same_bits_in_any_batch(split_tokens: int) -> None:
    """Each sequence alone, and the batch reversed, give the bits the whole batch gives."""
    streams = _long_streams()
    q, starts = _queries(6, seed=10)
    batch = decode_attention_native(q, starts, streams, SCALE, split_tokens=split_tokens)
    for seq in range(6):
        alone = [stream.select(torch.tensor([seq])) for stream in streams]
        single = decode_attention_native(q[seq : seq + 1], starts[:2], alone, SCALE, split_tokens)
        assert torch.equal(single[0], batch[seq])
    order = torch.arange(5, -1, -1)
    reversed_streams = [stream.select(order) for stream in streams]
    reversed_out = decode_attention_native(q[order], starts, reversed_streams, SCALE, split_tokens)
    assert torch.equal(reversed_out, batch[order])


@needs_compiler
def test_ids_outside_the_pool_and_short_tables_raise() -> None:
    streams = _three_streams(FORMATS["int4"], FORMATS["int4"])
    q, starts = _queries(5, seed=11)
    table = streams[0].block_table.clone()
    table[2, 1] = streams[0].k.codes.shape[0]
    with pytest.raises(IndexError, match="block"):
        decode_attention_native(q, starts, [dataclasses.replace(streams[0], block_table=table)], 1)
    short = dataclasses.replace(streams[0], block_table=streams[0].block_table[:, :9])
    with pytest.raises(ValueError, match="block_table"):
        decode_attention_native(q, starts, [short], 1)


@pytest.mark.parametrize(
    "variable,value", [(build.ENABLE_VARIABLE, "0"), (build.DISABLE_VARIABLE, "x,decode_attention")]
)
def test_disabled_kernels_leave_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """With KVTUNE_NATIVE=0, or this kernel named in KVTUNE_NATIVE_OFF, the kernel does
    nothing and the backend's decode is the torch path's, bit for bit."""
    monkeypatch.setenv(variable, value)
    streams = _three_streams(FORMATS["int4_channel"], FORMATS["int4"])
    q, starts = _queries(5, seed=12)
    assert decode_attention_native(q, starts, streams, SCALE) is None
    assert torch.equal(
        cache_attention_torch(q, None, starts, streams, SCALE),
        decode_attention_torch(q, starts, streams, SCALE),
    )


@needs_compiler
@pytest.mark.parametrize(
    "name,decode",
    [
        ("fp8", pool_codes.DECODE_E4M3),
        ("fp4", pool_codes.DECODE_E2M1),
        ("nvfp4", pool_codes.DECODE_E2M1),
        ("int8_symmetric", pool_codes.DECODE_SIGNED_BYTES),
        ("q8_0", pool_codes.DECODE_SIGNED_BYTES),
        ("int8", pool_codes.DECODE_BYTES),
        ("int4_channel", pool_codes.DECODE_NIBBLES),
        ("iq4_nl", pool_codes.DECODE_TABLE),
        ("int3", pool_codes.DECODE_PACKED),
        ("q5_1", pool_codes.DECODE_PACKED),
    ],
)
def test_codes_decode_by_arithmetic_where_it_equals_the_format(name: str, decode: int) -> None:
    """E4M3, E2M1 and plain integer codes decode by arithmetic (checked against the format's
    decode of every byte before use; a decode that differed would take the table); 3-bit and
    5-bit codes, across byte boundaries, by a table of every code."""
    assert pool_codes.pool_codes(_poisoned_pool(FORMATS[name], 1)).decode == decode
