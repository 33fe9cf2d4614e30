"""policy.rotation in the engine: the cache holds rotated K and V (llama.cpp's rotation: only the
quantized streams), and the logits equal exact attention over K and V that went through the
rotation, the format's round trip and the inverse rotation (a dense, cache-free oracle built
from the kernels' references). Where keys are a llama.cpp type, the oracle's queries also go
through the rotation and llama.cpp's q8_0 (the numpy port of ggml's x86 quantize_row_q8_0), as
llama.cpp's flash attention rounds them before q.k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref
from kvtune.kernels.formats.rotation import KVRotation, Rotation, kv_rotation
from kvtune.runtime import LLM
from kvtune.runtime.calibration import FREE_HEADROOM, calibration_token_ids
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model import DenseCausalAttention
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from tests.kernels.formats import llamacpp_formats_ref as llamacpp
from tests.runtime.test_engine import random_tokens, relative_error

ROTATED = KVPolicy("int4", "int2", group_size=16, rotation="hadamard", block_size=8, chunk_size=16)


def _round_trip(x: torch.Tensor, fmt) -> torch.Tensor:
    return dequantize_ref(*quantize_ref(x, fmt), fmt, None, x.shape[-1])


def _ggml_q8_0_round_trip(x: torch.Tensor, fmt=None) -> torch.Tensor:
    """x through ggml's q8_0 blocks as llama.cpp's x86 CPU quantizes a query (numpy port)."""
    blocks = llamacpp.quantize_row(x.float().numpy(), "q8_0")
    return torch.from_numpy(llamacpp.dequantize_row(blocks, "q8_0"))


def _through(
    x: torch.Tensor, rotation: Rotation | None, fmt, round_trip=_round_trip
) -> torch.Tensor:
    """x R -> quantize-dequantize -> R^T / gain (R: llama.cpp's fp32 transform as its CPU
    computes it, from the numpy port, where the rotation is llama.cpp's; else in fp64)."""
    if rotation is None:
        return round_trip(x, fmt)
    matrix = rotation.matrix.double()
    if rotation.butterflies:
        rotated = llamacpp.mul_mat_hadamard(x.float().numpy(), rotation.butterflies)
        rotated = torch.from_numpy(np.ascontiguousarray(rotated))
    else:
        rotated = (x.double() @ matrix).float()
    return (round_trip(rotated, fmt).double() @ matrix.T / rotation.gain).float()


class _RotatedFakeQuantAttention:
    """Dense causal attention over K, V -> x R -> quantize-dequantize -> x R^T / gain, per
    layer and for the streams `rotated` names (R R^T = gain I)."""

    def __init__(self, llm: LLM, num_tokens: int, rotated: tuple[bool, bool]) -> None:
        self.dense = DenseCausalAttention([num_tokens])
        self.formats = layer_formats(llm.arch, llm.policy)
        self.head_dim = llm.arch.head_dim
        self.rotation = llm.policy.rotation
        self.rotated = rotated

    def __call__(self, layer: int, q, k, v):
        rotation = kv_rotation(self.rotation, self.head_dim, layer)
        keys, values = (
            r if on else None
            for r, on in zip((rotation.keys, rotation.values), self.rotated, strict=True)
        )
        formats = self.formats[layer]
        if formats.k.dtype in llamacpp.BLOCK_BYTES:  # llama.cpp's queries meet its K types in q8_0
            q = _through(q, keys, None, _ggml_q8_0_round_trip).to(q.dtype)
        return self.dense(layer, q, _through(k, keys, formats.k), _through(v, values, formats.v))


# TurboQuant rotates keys only, with Lloyd-Max key codes over whole vectors (head_dim 32).
TURBOQUANT = ROTATED.replace(k_dtype="lloyd4", v_dtype="int3_tq", group_size=32)
# llama.cpp rotates a stream only where its type is quantized (head_dim 128: keys in blocks of
# 128, values in blocks of 64).
LLAMACPP = KVPolicy("q4_0", "fp16", rotation="llamacpp", block_size=8, chunk_size=16)


@pytest.mark.parametrize(
    ("policy", "rotated", "head_dim"),
    [
        (ROTATED.replace(rotation="hadamard"), (True, True), 32),
        (ROTATED.replace(rotation="vllm_rht"), (True, True), 32),
        (TURBOQUANT.replace(rotation="turboquant"), (True, False), 32),
        (LLAMACPP, (True, False), 128),
        (LLAMACPP.replace(k_dtype="fp16", v_dtype="q4_1"), (False, True), 128),
        (LLAMACPP.replace(v_dtype="iq4_nl"), (True, True), 128),
    ],
    ids=["hadamard", "vllm_rht", "turboquant", "llamacpp_k", "llamacpp_v", "llamacpp_kv"],
)
def test_rotated_cache_equals_dense_attention_over_rotated_round_trips(
    request, policy, rotated, head_dim
):
    model = request.getfixturevalue("tiny_llama" if head_dim == 32 else "tiny_llama_head_dim_128")
    tokens = random_tokens(40, seed=5)
    llm = LLM(str(model), policy=policy, max_model_len=64)
    logits = llm.prompt_logits(tokens)
    oracle = _RotatedFakeQuantAttention(llm, len(tokens), rotated)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = llm.model.forward(ids, torch.arange(len(tokens)), oracle)
        expected = llm.model.logits(hidden)
    assert relative_error(logits, expected) < 1e-4
    unrotated = LLM(str(model), policy=policy.replace(rotation="none"), max_model_len=64)
    assert relative_error(unrotated.prompt_logits(tokens), expected) > 1e-3


def test_rotation_matrices_are_built_once_and_only_for_quantized_layers(tiny_llama):
    layers = ("fp16/fp16", "int4/fp16")
    policy = ROTATED.replace(layer_dtypes=layers)
    cache = LLM(str(tiny_llama), policy=policy, max_model_len=64).engine.cache
    assert cache.rotations[0] == KVRotation()
    hadamard = kv_rotation("hadamard", 32, 1).keys.matrix
    assert torch.equal(cache.rotations[1].keys.matrix, hadamard)
    assert cache.rotations[1].values is cache.rotations[1].keys  # built once, shared


def test_llamacpp_rotation_reaches_only_the_quantized_streams(tiny_llama_head_dim_128):
    layers = ("fp16/fp16", "q8_0/fp16")
    policy = LLAMACPP.replace(layer_dtypes=layers)
    cache = LLM(str(tiny_llama_head_dim_128), policy=policy, max_model_len=64).engine.cache
    assert cache.rotations[0] == KVRotation()
    assert cache.rotations[1].values is None and cache.rotations[1].keys.butterflies == 128


@pytest.mark.parametrize(
    "rotated", [ROTATED, TURBOQUANT.replace(rotation="turboquant")], ids=["hadamard", "turboquant"]
)
def test_triton_backend_agrees_with_torch_on_a_rotated_compressed_cache(tiny_llama, rotated):
    """Rotated vectors in the fp16 recent pool, demoted and pooled into quantized summaries."""
    policy = rotated.replace(recent_unquantized=8, csa_ratio=2, csa_window=16, csa_sinks=4)
    tokens = random_tokens(40, seed=3)
    reference = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    triton = LLM(str(tiny_llama), policy=policy, backend="triton", max_model_len=64)
    assert relative_error(triton.prompt_logits(tokens), reference.prompt_logits(tokens)) < 1e-4
    expected = reference.generate([tokens[:20]], 6)[0].token_ids
    assert triton.generate([tokens[:20]], 6)[0].token_ids == expected


def test_tensor_scales_are_calibrated_on_the_rotated_vectors_the_cache_stores(tiny_llama):
    """fp8 per tensor: scale = FREE_HEADROOM * amax / 448 of each layer's rotated K and V on the
    calibration text (rotation changes the amax, so the unrotated one would clip or waste)."""
    policy = KVPolicy(
        "fp8", "fp8", group_size="tensor", rotation="hadamard", block_size=8, chunk_size=16
    )
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    ids = torch.tensor(calibration_token_ids(llm.tokenizer))
    dense = DenseCausalAttention([len(ids)])
    rotated_amax = {}

    def record(layer, q, k, v):
        matrix = kv_rotation("hadamard", 32, layer).keys.matrix
        rotated_amax[layer] = [(x.float() @ matrix).abs().max().item() for x in (k, v)]
        return dense(layer, q, k, v)

    with torch.no_grad():
        llm.model.forward(ids, torch.arange(len(ids)), record)
    plain = LLM(str(tiny_llama), policy=policy.replace(rotation="none"), max_model_len=64)
    for layer, pools in enumerate(llm.engine.cache.layers):
        for pool, amax in zip((pools.k[MAIN], pools.v[MAIN]), rotated_amax[layer], strict=True):
            assert pool.tensor_scale.item() == pytest.approx(FREE_HEADROOM * amax / 448, rel=1e-6)
        plain_scale = plain.engine.cache.layers[layer].k[MAIN].tensor_scale
        assert plain_scale.item() != pytest.approx(pools.k[MAIN].tensor_scale.item(), rel=1e-3)
