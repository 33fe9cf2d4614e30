"""The torch backend's decode attention (each pool dequantized straight into SDPA's layout)
equals SDPA over the vectors the pool's reference reader returns slot by slot, for every layout
of scales a format has (one scale row a vector or a token group, one group a vector or several,
with and without zero points), for codes decoded through the reference (Lloyd, zero in the
scale word, per-tensor fp8) and unquantized pools, and for every way a step hides vectors:
padding of unequal lengths, a last stream cut where its sequences end, per-KV-head query masks,
logit biases, or nothing at all."""

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvtune.kernels.attention.decode_torch import decode_attention_torch
from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.attention.paged_torch import cache_attention_torch
from kvtune.kernels.cache.pool import read_vectors_ref, write_vectors_ref
from kvtune.kernels.formats.kv_format import KVFormat
from tests.kernels.attention.test_attention import TOLERANCE, _poisoned_pool, relative_error

# Each test runs with the CPU kernels and with the torch paths alone.
pytestmark = pytest.mark.usefixtures("cpu_paths")

BLOCK = 16
FORMATS = {
    # One scale row a vector: one group (the CPU policy's rotated values), two, symmetric.
    "int4_g64": KVFormat("int4", 64),
    "int4_g32": KVFormat("int4", 32),
    "fp8_g16": KVFormat("fp8", 16),
    # One scale row a token group: per channel over a block (KIVI keys), pairs of channels,
    # groups of 16 channels over token pairs.
    "int4_channel": KVFormat("int4", 1, "fp16", token_group=BLOCK),
    "int2_g2_channel": KVFormat("int2", 2, "fp16", token_group=BLOCK),
    "fp4_g16_token_pairs": KVFormat("fp4", 16, "fp16", token_group=2),
    # Unquantized, and codes decoded through the reference reader.
    "fp16": KVFormat("fp16"),
    "fp8": KVFormat("fp8"),
    "lloyd4_g64": KVFormat("lloyd4", 64),
    "int4_zp_in_scale_g64": KVFormat("int4_zp_in_scale", 64, "fp32"),
}
PAIRS = [
    ("int4_channel", "int4_g64"),
    ("int2_g2_channel", "fp4_g16_token_pairs"),
    ("fp4_g16_token_pairs", "int4_g32"),
    ("int4_g32", "fp8_g16"),
    ("fp8_g16", "int4_channel"),
    ("lloyd4_g64", "int2_g2_channel"),
    ("int4_g64", "fp16"),
    ("int4_zp_in_scale_g64", "fp8_g16"),
]
HEADS, GROUP, DIM = 2, 3, 64


@dataclass
class Stored:
    """A stream and, per sequence, the dense vectors its pools return for it."""

    stream: PagedStream
    keys: list[torch.Tensor]  # [L, H, D]
    values: list[torch.Tensor]


def _stored_stream(
    lengths: list[int], k_fmt: KVFormat, v_fmt: KVFormat, seed: int, logit_bias: float = 0.0
) -> Stored:
    """Random vectors written in whole token groups to shuffled blocks of pools whose other
    slots decode to NaN; the dense vectors are what the reference reader returns per slot."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=generator)
    pools = [_poisoned_pool(fmt, num_blocks, BLOCK, HEADS, DIM) for fmt in (k_fmt, v_fmt)]
    table = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for seq, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        ids = order[used : used + count]
        used += count
        table[seq, :count] = ids.to(torch.int32)
        slots = ids[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK
        for pool, dense in zip(pools, (keys, values), strict=True):
            write_vectors_ref(pool, slots, torch.randn(length, HEADS, DIM, generator=generator))
            dense.append(read_vectors_ref(pool, slots))
    stream = PagedStream(
        pools[0],
        pools[1],
        table,
        torch.tensor(lengths, dtype=torch.int32),
        torch.zeros(len(lengths), dtype=torch.int32),
        logit_bias=logit_bias,
    )
    return Stored(stream, keys, values)


def _lengths(*formats: KVFormat) -> list[int]:
    """Sequence lengths with partial blocks and an empty sequence, in whole token groups."""
    rows = max(fmt.token_group for fmt in formats)
    return [-(-n // rows) * rows for n in (0, 1, 37, 150, 8)]


def _oracle(q, cases, query_mask, scale) -> torch.Tensor:
    """SDPA of each sequence's query over its streams' dense vectors, each stream's logit bias
    added, the main stream's vectors hidden per KV head where query_mask says."""
    out = torch.zeros_like(q)
    for seq in range(q.shape[0]):
        keys = torch.cat([case.keys[seq] for case in cases])
        if not len(keys):
            continue
        values = torch.cat([case.values[seq] for case in cases])
        bias = torch.cat(
            [torch.full((len(case.keys[seq]),), case.stream.logit_bias) for case in cases]
        )
        main = len(cases[0].keys[seq])
        visible = torch.ones(HEADS, len(keys), dtype=torch.bool)
        visible[:, :main] = query_mask[seq, :, :main]
        mask = torch.where(visible, bias, -math.inf).repeat_interleave(GROUP, dim=0)
        result = F.scaled_dot_product_attention(
            q[seq][None, :, None, :],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask[None, :, None, :],
            scale=scale,
            enable_gqa=True,
        )[0, :, 0]
        out[seq] = result.nan_to_num(0.0)  # a head that sees nothing: 0, as the runtime gives
    return out


@pytest.mark.parametrize("k_name,v_name", PAIRS)
def test_decode_with_padding_and_query_masks_matches_sdpa(k_name, v_name):
    k_fmt, v_fmt = FORMATS[k_name], FORMATS[v_name]
    lengths = _lengths(k_fmt, v_fmt)
    main = _stored_stream(lengths, k_fmt, v_fmt, seed=1)
    tail = _stored_stream([3, 0, 5, 1, 16], FORMATS["fp8"], FORMATS["fp16"], 2, logit_bias=0.7)
    generator = torch.Generator().manual_seed(3)
    # Each KV head hides its own vectors of the main stream (a selecting step's summaries);
    # one head of sequence 4 sees only the tail.
    query_mask = torch.rand(len(lengths), HEADS, max(lengths), generator=generator) < 0.8
    query_mask[4, 1] = False
    streams = [dataclasses.replace(main.stream, query_mask=query_mask), tail.stream]
    q = torch.randn(len(lengths), HEADS * GROUP, DIM, generator=generator)
    starts = torch.arange(len(lengths) + 1, dtype=torch.int32)
    scale = DIM**-0.5

    expected = _oracle(q, [main, tail], query_mask, scale)
    actual = decode_attention_torch(q, starts, streams, scale)
    assert not actual.isnan().any()
    assert relative_error(actual, expected) <= TOLERANCE
    through_backend = cache_attention_torch(q, None, starts, streams, scale)
    assert relative_error(through_backend, expected) <= TOLERANCE


@pytest.mark.parametrize("k_name,v_name", PAIRS)
def test_decode_of_whole_blocks_alone(k_name, v_name):
    """A batch of one sequence in whole blocks, without a query mask: the path that masks
    nothing (a batch-1 decode step's int4 stream)."""
    main = _stored_stream([3 * BLOCK], FORMATS[k_name], FORMATS[v_name], seed=4)
    q = torch.randn(1, HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([0, 1], dtype=torch.int32)
    shows_all = torch.ones(1, HEADS, 3 * BLOCK, dtype=torch.bool)
    expected = _oracle(q, [main], shows_all, DIM**-0.5)
    actual = decode_attention_torch(q, starts, [main.stream], DIM**-0.5)
    assert relative_error(actual, expected) <= TOLERANCE


@pytest.mark.parametrize("k_name,v_name", PAIRS)
def test_decode_of_equal_lengths_cuts_the_last_stream(k_name, v_name):
    """Sequences that all end at one length in a stream of partial blocks: it is cut there, its
    poisoned rows past the length written over by the next stream or left out after the last;
    a biased stream of whole blocks needs only its bias, and a stream of unequal lengths after
    a cut one is masked."""
    k_fmt, v_fmt = FORMATS[k_name], FORMATS[v_name]
    rows = max(k_fmt.token_group, v_fmt.token_group)
    partial = -(-37 // rows) * rows
    main = _stored_stream([partial] * 3, k_fmt, v_fmt, seed=6)
    whole = _stored_stream([2 * BLOCK] * 3, k_fmt, v_fmt, seed=7, logit_bias=-0.4)
    tail = _stored_stream([5] * 3, FORMATS["fp16"], FORMATS["fp16"], seed=8)
    unequal = _stored_stream([3, 0, 20], FORMATS["fp8"], FORMATS["int4_g32"], seed=10)
    q = torch.randn(3, HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(9))
    starts = torch.arange(4, dtype=torch.int32)
    scale = DIM**-0.5
    for cases in ([main, whole, tail], [whole, main], [main], [tail], [main, unequal, tail]):
        shows_all = torch.ones(3, HEADS, len(cases[0].keys[0]), dtype=torch.bool)
        expected = _oracle(q, cases, shows_all, scale)
        actual = decode_attention_torch(q, starts, [case.stream for case in cases], scale)
        assert relative_error(actual, expected) <= TOLERANCE, [len(c.keys[0]) for c in cases]
