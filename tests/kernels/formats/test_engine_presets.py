"""The engine presets (conf/policy/vllm, conf/policy/sglang) store what the engines store.

Each preset is composed by Hydra as `policy=<engine>/<dtype>` selects it, turned into K and V
formats by the policy, and written into paged pools by the Triton cache-write kernel and by the
torch reference. The codes and scales read back must equal, bit for bit, those of the engine's
format as `tests/kernels/formats/engine_formats_ref.py` encodes it (numpy, written from the engines'
sources, no kvtune imports), on random and on outlier-heavy data, and the bytes a token costs
per KV head must equal that reference's byte formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from kvtune.kernels.cache.pool import KVPool, read_vectors_ref
from kvtune.kernels.cache.write import write_kv, write_kv_ref
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import kv_rotation, rotate, unrotate
from kvtune.runtime.calibration import tensor_scale
from kvtune.runtime.policy import KVPolicy
from tests.kernels.formats import engine_formats_ref as ref

CONF = Path(__file__).resolve().parents[3] / "conf"
BLOCK, NUM_BLOCKS, HEADS, DIM = 16, 4, 2, 64
TOKENS = 40
Encoded = tuple[np.ndarray, np.ndarray | None]


@dataclass(frozen=True)
class Engine:
    """An engine's --kv-cache-dtype: its name for the byte formula and its reference encoder
    and decoder (x [..., D] float32 -> (codes as stored, scales as stored or None), scales
    [..., scales per vector] as kvtune lays them out). per_vector: one scale per vector, the
    preset's group_size is the model's head_dim."""

    engine: str
    dtype: str
    encode: Callable[[np.ndarray], Encoded]
    decode: Callable[[np.ndarray, np.ndarray | None], np.ndarray]
    per_vector: bool = False


def per_token_head(kind: str) -> Engine:
    def encode(x: np.ndarray) -> Encoded:
        codes, scales = ref.encode_per_token_head(x, kind)
        return codes, scales[..., None]

    def decode(codes: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        return ref.decode_per_token_head(codes, scales[..., 0], kind)

    return Engine("vllm", f"{kind}_per_token_head", encode, decode, per_vector=True)


PRESETS = {
    "vllm/fp8": Engine(
        "vllm",
        "fp8",
        lambda x: (ref.encode_fp8_per_tensor(x, 1.0), None),
        lambda codes, _: ref.decode_fp8_per_tensor(codes, 1.0),
    ),
    "sglang/fp8_e4m3": Engine(
        "sglang",
        "fp8_e4m3",
        lambda x: (ref.encode_fp8_per_tensor_sglang(x, None), None),
        lambda codes, _: ref.decode_fp8_per_tensor(codes, 1.0),
    ),
    "vllm/nvfp4": Engine(
        "vllm", "nvfp4", lambda x: ref.encode_nvfp4(x, 1.0), lambda c, s: ref.decode_nvfp4(c, s)
    ),
    "vllm/nvfp4_4over6": Engine(
        "vllm",
        "nvfp4_4over6",
        lambda x: ref.encode_nvfp4(x, 1.0, four_over_six=True),
        lambda c, s: ref.decode_nvfp4(c, s),
    ),
    "sglang/nvfp4": Engine(
        "sglang", "nvfp4", lambda x: ref.encode_nvfp4(x, 1.0), lambda c, s: ref.decode_nvfp4(c, s)
    ),
    "vllm/fp8_per_token_head": per_token_head("fp8"),
    "vllm/int8_per_token_head": per_token_head("int8"),
    "sglang/fp4_mx_block16": Engine(
        "sglang", "fp4_mx_block16", ref.encode_fp4_mx_block16, ref.decode_fp4_mx_block16
    ),
}


def preset_policy(name: str, *overrides: str) -> KVPolicy:
    """The policy `policy=<name>` composes to (Hydra, as the CLI does; SmolLM2 by default)."""
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("plan", overrides=[f"policy={name}", *overrides])
    return KVPolicy.from_dict(dict(cfg.policy))


def preset_formats(name: str, head_dim: int = DIM) -> tuple[KVFormat, KVFormat]:
    """K and V formats of a preset for vectors of head_dim elements (a per-vector preset's
    group_size is the model's head_dim)."""
    policy = preset_policy(name)
    if PRESETS[name].per_vector:
        policy = policy.replace(group_size=head_dim)
    return (
        policy.kv_format(policy.k_dtype, "bf16", keys=True),
        policy.kv_format(policy.v_dtype, "bf16"),
    )


def as_bf16(x: np.ndarray) -> torch.Tensor:
    """Activations as a bf16 model hands them over (bf16 values, kept in fp32)."""
    return torch.from_numpy(x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))


def random_vectors(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return as_bf16(rng.standard_normal((TOKENS, HEADS, DIM)) * 2.0)


def outlier_vectors(seed: int) -> torch.Tensor:
    """Fixed outlier channels (as RoPE'd keys have), values beyond E4M3's 448 and E2M1's reach,
    tiny values near the scale formats' subnormals, a zero vector, and exact halfway points of
    the E2M1 grid (a block of amax 6 has scale 1 in every fp4 format) and of int8."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((TOKENS, HEADS, DIM))
    x[:, :, [3, 17, 40]] *= [40.0, -300.0, 900.0]
    x[5] *= 1e-5
    x[6] = 0.0
    x[7, :, :16] = [6.0, 2.5, -5.0, 0.25, 0.75, -1.25, 1.75, 3.5, 5.0, -0.0, 0.5, 1, 1.5, 2, 3, 4]
    x[8, 0, ::7] = [1e4, -2e3, 600.0, -449.0, 464.0, 1e-3, -3e-7, 7e-8, 5e2, 0.01]
    x[9, 1, ::2] = 1.5 * 2.0 ** rng.integers(-40, 40, DIM // 2)  # every binade, odd ones out
    # amax 127: int8's scale is 1, so these are its halfway points (away from zero, not even).
    x[10, 0] = 0.0
    x[10, 0, :8] = [127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5]
    return as_bf16(x)


DATA = {"random": random_vectors, "outliers": outlier_vectors}


def write_both(fmt_k: KVFormat, fmt_v: KVFormat, k: torch.Tensor, v: torch.Tensor, slots):
    """Pools written by the Triton kernel and by the torch reference, with the tensor scales the
    runtime would give these formats (measured from the data where calibrated)."""
    scales = [tensor_scale(fmt, float(x.abs().max())) for fmt, x in ((fmt_k, k), (fmt_v, v))]
    pools = []
    for write in (write_kv, write_kv_ref):
        k_pool, v_pool = (
            KVPool.allocate(fmt, NUM_BLOCKS, BLOCK, HEADS, DIM, scale)
            for fmt, scale in zip((fmt_k, fmt_v), scales, strict=True)
        )
        write(k, v, slots, k_pool, v_pool)
        pools.append((k_pool, v_pool))
    return pools


def stored(pool: KVPool, slots: torch.Tensor) -> Encoded:
    """Codes and scales of the vectors at slots, as numpy arrays of the stored dtypes."""
    codes = pool.codes.flatten(0, 1)[slots.long()].numpy()
    if pool.scales is None:
        return codes, None
    return codes, pool.scales.flatten(0, 1)[slots.long()].numpy()


def assert_same_bits(actual: np.ndarray | None, expected: np.ndarray | None) -> None:
    if expected is None:
        assert actual is None
        return
    assert actual.nbytes == expected.nbytes and actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_stores_the_engines_codes_and_scales(name, data):
    engine = PRESETS[name]
    fmt_k, fmt_v = preset_formats(name)
    k, v = DATA[data](0), DATA[data](1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(2))[:TOKENS]
    for k_pool, v_pool in write_both(fmt_k, fmt_v, k, v, slots):
        for pool, x in ((k_pool, k), (v_pool, v)):
            assert float(pool.tensor_scale) == 1.0  # the engines' scale without checkpoint ones
            codes, scales = engine.encode(x.numpy())
            stored_codes, stored_scales = stored(pool, slots)
            assert_same_bits(stored_codes, codes)
            assert_same_bits(stored_scales, scales)
            np.testing.assert_array_equal(
                read_vectors_ref(pool, slots).numpy(), engine.decode(codes, scales)
            )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_bytes_per_token_head_follow_the_engine(name):
    engine = PRESETS[name]
    for head_dim in (64, 128):
        fmt_k, fmt_v = preset_formats(name, head_dim)
        expected = ref.kv_bytes_per_token_head(engine.engine, engine.dtype, head_dim)
        assert fmt_k.vector_bytes(head_dim) + fmt_v.vector_bytes(head_dim) == expected
        per_block = fmt_k.block_bytes(head_dim, BLOCK) + fmt_v.block_bytes(head_dim, BLOCK)
        assert per_block == BLOCK * expected
    fmt_k, fmt_v = preset_formats(name)
    k_pool = KVPool.allocate(fmt_k, NUM_BLOCKS, BLOCK, HEADS, DIM)
    v_pool = KVPool.allocate(fmt_v, NUM_BLOCKS, BLOCK, HEADS, DIM)
    allocated = sum(
        t.numel() * t.element_size()
        for p in (k_pool, v_pool)
        for t in (p.codes, p.scales)
        if t is not None
    )
    assert allocated == NUM_BLOCKS * BLOCK * HEADS * ref.kv_bytes_per_token_head(
        engine.engine, engine.dtype, DIM
    )


def test_calibrated_tensor_scale_is_the_alternative_and_changes_the_codes():
    """tensor_scale=calibrated (kvtune's own mode) measures a scale: not what vLLM stores."""
    policy = preset_policy("vllm/nvfp4").replace(tensor_scale="calibrated")
    fmt = policy.kv_format("fp4", "bf16")
    x = outlier_vectors(0)
    scale = tensor_scale(fmt, float(x.abs().max()))
    assert scale is not None and float(scale) != 1.0
    pool = KVPool.allocate(fmt, NUM_BLOCKS, BLOCK, HEADS, DIM, scale)
    slots = torch.arange(TOKENS)
    write_kv_ref(x, x, slots, pool, KVPool.allocate(fmt, NUM_BLOCKS, BLOCK, HEADS, DIM, scale))
    assert not np.array_equal(stored(pool, slots)[1], ref.encode_nvfp4(x.numpy(), 1.0)[1])


def test_per_vector_presets_take_the_models_head_dim_as_group():
    """One scale per vector whatever the model: group_size follows model.head_dim."""
    for name, engine in PRESETS.items():
        if engine.per_vector:
            assert preset_policy(name).group_size == DIM  # SmolLM2
            assert preset_policy(name, "model=llama-3.1-8b").group_size == 128


@pytest.mark.parametrize("power", [-30, -3, 0, 5, 40])
def test_ue8m0_exponent_is_exact_next_to_powers_of_two(power):
    """fp4_mx_block16's scale exponent is ceil(log2(amax / 6)), computed here in float64 (exact
    for these float32 inputs): a block whose amax / 6 is a power of two keeps it, one ulp above
    takes the next power (where float32 log2 may round down)."""
    fmt_k, _ = preset_formats("sglang/fp4_mx_block16")
    at = np.float32(6.0 * 2.0**power)
    amaxes = [at, np.nextafter(at, np.float32(np.inf)), np.nextafter(at, np.float32(0))]
    x = np.zeros((len(amaxes), 1, DIM), np.float32)
    x[:, 0, 0] = amaxes
    pool = KVPool.allocate(fmt_k, 1, BLOCK, 1, DIM)
    slots = torch.arange(len(amaxes))
    write_kv(torch.from_numpy(x), torch.from_numpy(x), slots, pool, pool)
    quotients = np.array(amaxes, np.float32) / np.float32(6.0)  # float32, as the engine divides
    exact = [math.ceil(math.log2(float(q))) for q in quotients]
    assert exact[1] == exact[0] + 1 == exact[2] + 1
    assert pool.scales[0, : len(amaxes), 0, 0].tolist() == [e + 127 for e in exact]


def reciprocal_sensitive_vectors(q_max: float, rounding: Callable[[np.ndarray], np.ndarray]):
    """Vectors [N, 1, DIM] of bf16 values whose element x rounds differently as x / scale and as
    x * float32(1 / scale), scale = amax / q_max (element 0 is the amax): the two ways an
    engine can apply a per-vector scale."""
    grid = np.arange(0x3F80, 0x4100, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    amax, x = (a.ravel() for a in np.meshgrid(grid, grid, indexing="ij"))
    scale = amax / np.float32(q_max)
    divided, multiplied = rounding(x / scale), rounding(x * (np.float32(1.0) / scale))
    pick = np.nonzero((x <= amax) & (divided != multiplied))[0][:8]
    assert len(pick) > 0
    vectors = np.zeros((len(pick), 1, DIM), np.float32)
    vectors[:, 0, 0], vectors[:, 0, 1] = amax[pick], x[pick]
    return torch.from_numpy(vectors)


def e4m3_codes(y: np.ndarray) -> np.ndarray:
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@pytest.mark.parametrize(
    ("kind", "q_max", "rounding"),
    [("fp8", 448.0, e4m3_codes), ("int8", 127.0, ref.round_half_away)],
)
def test_per_token_head_multiplies_by_the_reciprocal_of_the_scale(kind, q_max, rounding):
    """vLLM multiplies by the fp32 reciprocal of the scale: where that rounds differently from
    a division, the preset follows vLLM."""
    fmt_k, _ = preset_formats(f"vllm/{kind}_per_token_head")
    vectors = reciprocal_sensitive_vectors(q_max, rounding)
    slots = torch.arange(len(vectors))
    by_kernel, by_reference = (KVPool.allocate(fmt_k, 1, BLOCK, 1, DIM) for _ in range(2))
    write_kv(vectors, vectors, slots, by_kernel, KVPool.allocate(fmt_k, 1, BLOCK, 1, DIM))
    write_kv_ref(vectors, vectors, slots, by_reference, KVPool.allocate(fmt_k, 1, BLOCK, 1, DIM))
    codes, _ = ref.encode_per_token_head(vectors.numpy(), kind)
    for pool in (by_kernel, by_reference):
        np.testing.assert_array_equal(stored(pool, slots)[0], codes)


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int4_per_token_head_stores_vllms_rotated_codes_and_scale_words(data, head_dim):
    """The preset rotates (vllm_rht, rounded back to bf16 as vLLM does) before the cache write;
    the reference rotates inside its encoder. Codes and scale words bit for bit; values read
    back and un-rotated agree with the reference's (which decodes in fp64) to fp32 rounding."""
    policy = preset_policy("vllm/int4_per_token_head", f"model.head_dim={head_dim}")
    fmt = policy.kv_format(policy.k_dtype, "bf16", keys=True)
    expected_bytes = ref.kv_bytes_per_token_head("vllm", "int4_per_token_head", head_dim)
    assert 2 * fmt.vector_bytes(head_dim) == expected_bytes
    rotation = kv_rotation(policy.rotation, head_dim, layer=3)
    assert rotation.keys is rotation.values
    rotation = rotation.keys
    x = DATA[data](0)
    if head_dim != DIM:
        x = torch.cat((x, x.flip(-1)), dim=-1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(2))[:TOKENS]
    rotated = rotate(x.to(torch.bfloat16), rotation)
    codes, words = ref.encode_int4_per_token_head(x.numpy(), "bfloat16")
    for write in (write_kv, write_kv_ref):
        k_pool, v_pool = (
            KVPool.allocate(fmt, NUM_BLOCKS, BLOCK, HEADS, head_dim) for _ in range(2)
        )
        write(rotated, rotated, slots, k_pool, v_pool)
        stored_codes, stored_words = stored(k_pool, slots)
        assert_same_bits(stored_codes, codes)
        assert_same_bits(stored_words[..., 0], words)
        restored = unrotate(read_vectors_ref(k_pool, slots), rotation)
        expected = ref.decode_int4_per_token_head(codes, words)
        np.testing.assert_allclose(restored.numpy(), expected, rtol=1e-5, atol=1e-6)


TURBOQUANT = sorted(ref.TURBOQUANT_PRESETS)


def turboquant_slots(k_pool: KVPool, v_pool: KVPool, slots: torch.Tensor) -> np.ndarray:
    """vLLM's slot layout from kvtune's pools: [K codes | K norm | V codes | V scale | V zero]
    (the fp16 fields as little-endian bytes); kvtune keeps the same bytes in four tensors."""
    parts = []
    for pool in (k_pool, v_pool):
        codes, scales = stored(pool, slots)
        parts.append(codes)
        if scales is not None:
            parts.append(np.ascontiguousarray(scales).view(np.uint8))
    return np.concatenate(parts, axis=-1)


def near_a_boundary(k: np.ndarray, bits: int, tolerance: float = 1e-6) -> np.ndarray:
    """Per element of k [..., D]: whether its rotated unit coordinate lies within `tolerance`
    of a decision boundary of the codebook (where rotating before or after normalizing, in
    fp64 or fp32, may pick either neighbour)."""
    d = k.shape[-1]
    k64 = k.astype(np.float64)
    unit = k64 / (np.sqrt((k64**2).sum(-1, keepdims=True)) + 1e-8)
    y = unit @ ref.orthonormal_hadamard(d)
    _, boundaries = ref.lloyd_max_gaussian(d, bits)
    return (np.abs(y[..., None] - boundaries) < tolerance).any(-1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference decodes inf norms
@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", TURBOQUANT)
def test_turboquant_presets_store_vllms_slots(name, head_dim, data):
    """Keys rotated by the preset's rotation (keys only) and written by the kernel and by the
    torch reference hold vLLM's slot bytes: Lloyd-Max codes and fp16 norms (or raw E4M3 for
    k8v4), value codes with fp16 scale and zero, 3-bit codes eight in three bytes. A key code
    may differ only where the coordinate sits within float rounding of a decision boundary
    (vLLM normalizes then rotates in fp32; kvtune rotates in fp64, then normalizes); the
    values are unrotated and equal everywhere. Values read back equal the reference's decode
    (un-rotated keys to fp32 rounding)."""
    preset = ref.TURBOQUANT_PRESETS[name]
    policy = preset_policy(f"vllm/{name}", f"model.head_dim={head_dim}")
    fmt_k = policy.kv_format(policy.k_dtype, "bf16", keys=True)
    fmt_v = policy.kv_format(policy.v_dtype, "bf16")
    rotations = kv_rotation(policy.rotation, head_dim, layer=5)
    rotation = rotations.keys
    k, v = DATA[data](0), DATA[data](1)
    if head_dim != DIM:
        k, v = (torch.cat((x, x.flip(-1)), dim=-1) for x in (k, v))
    cached_k = k if rotation is None else rotate(k, rotation)
    assert rotations.values is None
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(2))[:TOKENS]
    expected = ref.encode_turboquant(k.numpy(), v.numpy(), name)
    key_bytes = ref.turboquant_key_bytes(preset, head_dim)
    for write in (write_kv, write_kv_ref):
        k_pool, v_pool = (
            KVPool.allocate(fmt, NUM_BLOCKS, BLOCK, HEADS, head_dim) for fmt in (fmt_k, fmt_v)
        )
        write(cached_k, v, slots, k_pool, v_pool)
        actual = turboquant_slots(k_pool, v_pool, slots)
        assert actual.shape == expected.shape  # the four presets need no padding at 64 / 128
        np.testing.assert_array_equal(actual[..., key_bytes:], expected[..., key_bytes:])
        if preset.key_bits == 8:
            np.testing.assert_array_equal(actual[..., :key_bytes], expected[..., :key_bytes])
            continue
        np.testing.assert_array_equal(actual[..., key_bytes - 2 :], expected[..., key_bytes - 2 :])
        codes = [
            ref.unpack_lsb_first(slot[..., : key_bytes - 2], preset.key_bits, head_dim)
            for slot in (actual, expected)
        ]
        differ = codes[0] != codes[1]
        assert not (differ & ~near_a_boundary(k.numpy(), preset.key_bits)).any()
        keys, values = ref.decode_turboquant(actual, name, head_dim)
        np.testing.assert_array_equal(read_vectors_ref(v_pool, slots).numpy(), values)
        restored = unrotate(read_vectors_ref(k_pool, slots), rotation)
        finite = np.isfinite(keys)
        np.testing.assert_allclose(restored.numpy()[finite], keys[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", TURBOQUANT)
def test_turboquant_preset_bytes_and_boundary_layers_follow_vllm(name):
    for head_dim in (64, 128):
        policy = preset_policy(f"vllm/{name}", f"model.head_dim={head_dim}")
        fmt_k = policy.kv_format(policy.k_dtype, "bf16", keys=True)
        fmt_v = policy.kv_format(policy.v_dtype, "bf16")
        expected = ref.kv_bytes_per_token_head("vllm", name, head_dim)
        assert fmt_k.vector_bytes(head_dim) + fmt_v.vector_bytes(head_dim) == expected
        assert fmt_k.block_bytes(head_dim, BLOCK) + fmt_v.block_bytes(head_dim, BLOCK) == (
            BLOCK * expected
        )
    for num_layers in (1, 3, 4, 30, 32):
        pairs = preset_policy(f"vllm/{name}").layer_pairs(num_layers)
        kept = [i for i, pair in enumerate(pairs) if pair == ("fp16", "fp16")]
        assert kept == ref.turboquant_skip_layers(num_layers)
