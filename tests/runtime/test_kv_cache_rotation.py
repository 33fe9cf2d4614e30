"""policy.rotation=hadamard in the engine: the cache holds rotated K and V, and the logits equal
exact attention over K and V that went through the rotation, the format's round trip and the
inverse rotation (a dense, cache-free oracle built from the kernels' references)."""

from __future__ import annotations

import pytest
import torch

from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref
from kvtune.kernels.formats.rotation import rotation_matrix
from kvtune.runtime import LLM
from kvtune.runtime.calibration import FREE_HEADROOM, calibration_token_ids
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model import DenseCausalAttention
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from tests.runtime.test_engine import random_tokens, relative_error

ROTATED = KVPolicy("int4", "int2", group_size=16, rotation="hadamard", block_size=8, chunk_size=16)


def _round_trip(x: torch.Tensor, fmt) -> torch.Tensor:
    return dequantize_ref(*quantize_ref(x, fmt), fmt, None, x.shape[-1])


class _RotatedFakeQuantAttention:
    """Dense causal attention over K, V -> x R -> quantize-dequantize -> x R^T / gain, per
    layer (R R^T = gain I)."""

    def __init__(self, llm: LLM, num_tokens: int, rotates_values: bool) -> None:
        self.dense = DenseCausalAttention([num_tokens])
        self.formats = layer_formats(llm.arch, llm.policy)
        self.head_dim = llm.arch.head_dim
        self.rotation = llm.policy.rotation
        self.rotates_values = rotates_values

    def __call__(self, layer: int, q, k, v):
        rotation = rotation_matrix(self.rotation, self.head_dim, layer)
        matrix, gain = rotation.matrix.double(), rotation.gain
        formats = self.formats[layer]
        k = _round_trip((k.double() @ matrix).float(), formats.k).double() @ matrix.T / gain
        if self.rotates_values:
            v = _round_trip((v.double() @ matrix).float(), formats.v).double() @ matrix.T / gain
        else:
            v = _round_trip(v, formats.v)
        return self.dense(layer, q, k.float(), v.float())


# TurboQuant rotates keys only, with Lloyd-Max key codes over whole vectors (head_dim 32).
TURBOQUANT = ROTATED.replace(k_dtype="lloyd4", v_dtype="int3_tq", group_size=32)


@pytest.mark.parametrize(
    ("policy", "rotates_values"),
    [
        (ROTATED.replace(rotation="hadamard"), True),
        (ROTATED.replace(rotation="vllm_rht"), True),
        (TURBOQUANT.replace(rotation="turboquant"), False),
    ],
    ids=["hadamard", "vllm_rht", "turboquant"],
)
def test_rotated_cache_equals_dense_attention_over_rotated_round_trips(
    tiny_llama, policy, rotates_values
):
    tokens = random_tokens(40, seed=5)
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    logits = llm.prompt_logits(tokens)
    oracle = _RotatedFakeQuantAttention(llm, len(tokens), rotates_values)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = llm.model.forward(ids, torch.arange(len(tokens)), oracle)
        expected = llm.model.logits(hidden)
    assert relative_error(logits, expected) < 1e-4
    unrotated = LLM(str(tiny_llama), policy=policy.replace(rotation="none"), max_model_len=64)
    assert relative_error(unrotated.prompt_logits(tokens), expected) > 1e-3


def test_rotation_matrices_are_built_once_and_only_for_quantized_layers(tiny_llama):
    layers = ("fp16/fp16", "int4/fp16")
    policy = ROTATED.replace(layer_dtypes=layers)
    cache = LLM(str(tiny_llama), policy=policy, max_model_len=64).engine.cache
    assert cache.rotations[0] is None
    assert torch.equal(cache.rotations[1].matrix, rotation_matrix("hadamard", 32, 1).matrix)


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
        matrix = rotation_matrix("hadamard", 32, layer).matrix
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
