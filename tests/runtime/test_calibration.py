"""Calibrated tensor scales: measured on the calibration conversation as the model reads it,
with headroom only where it is free.

Oracles: transformers' own chat template rendering for the token ids, a dense forward pass that
records each layer's largest |K| and |V| for the scales, and ml_dtypes' E2M1 for what a
per-tensor fp4 cache keeps of those keys.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref
from kvtune.runtime import LLM
from kvtune.runtime.calibration import CALIBRATION_REPLY, CALIBRATION_TEXT, calibration_token_ids
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model import DenseCausalAttention
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from tests.runtime.test_engine import random_tokens


def recorded_keys_and_values(llm: LLM) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V over the calibration tokens, from a dense forward pass."""
    ids = torch.tensor(calibration_token_ids(llm.tokenizer))
    dense = DenseCausalAttention([len(ids)])
    recorded = {}

    def record(layer, q, k, v):
        recorded[layer] = (k.float().clone(), v.float().clone())
        return dense(layer, q, k, v)

    with torch.no_grad():
        llm.model.forward(ids, torch.arange(len(ids)), record)
    return recorded


@pytest.mark.slow
def test_calibration_reads_the_conversation_through_the_chat_template(smollm2_folder):
    from transformers import AutoTokenizer

    llm = LLM("smollm2-135m", policy=KVPolicy("fp16", "fp16"), max_model_len=1024)
    messages = [
        {"role": "user", "content": CALIBRATION_TEXT},
        {"role": "assistant", "content": CALIBRATION_REPLY},
    ]
    reference = AutoTokenizer.from_pretrained(smollm2_folder).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False
    )
    reference = reference["input_ids"] if hasattr(reference, "keys") else list(reference)
    assert calibration_token_ids(llm.tokenizer) == reference


def test_a_model_without_a_chat_template_reads_the_plain_text(tiny_llama):
    llm = LLM(str(tiny_llama), policy=KVPolicy("fp16", "fp16", block_size=8), max_model_len=64)
    assert llm.tokenizer.chat_template is None
    assert calibration_token_ids(llm.tokenizer) == llm.tokenizer.encode(CALIBRATION_TEXT)


# (policy, expected tensor scale from a layer's amax): headroom 2 where E4M3 keeps relative
# precision, none for per-tensor fp4 codes.
CASES = [
    (KVPolicy("fp4", "fp4", group_size="tensor"), lambda amax: amax / 6),
    (KVPolicy("fp8", "fp8", group_size="tensor"), lambda amax: 2 * amax / 448),
    (KVPolicy("fp4", "fp4", group_size=16, scale_dtype="e4m3"), lambda amax: 2 * amax / 2688),
]


@pytest.mark.parametrize("policy,expected", CASES)
def test_tensor_scales_follow_each_layers_calibrated_maximum(tiny_llama, policy, expected):
    llm = LLM(str(tiny_llama), policy=policy.replace(block_size=8), max_model_len=64)
    recorded = recorded_keys_and_values(llm)
    for layer, pools in enumerate(llm.engine.cache.layers):
        for pool, values in zip((pools.k[MAIN], pools.v[MAIN]), recorded[layer], strict=True):
            amax = values.abs().max().item()
            assert pool.tensor_scale.item() == pytest.approx(expected(amax), rel=1e-6)


def test_per_tensor_fp4_keys_keep_more_without_headroom(tiny_llama):
    """What the calibrated fp4 scale keeps of the calibration keys, against the old 2x headroom
    (which left the largest value at code 3 of 6)."""
    llm = LLM(
        str(tiny_llama),
        policy=KVPolicy("fp4", "fp4", group_size="tensor", block_size=8),
        max_model_len=64,
    )
    keys = recorded_keys_and_values(llm)[0][0].numpy()

    def error(scale: float) -> float:
        codes = (keys / np.float32(scale)).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        return float(np.linalg.norm(codes * scale - keys) / np.linalg.norm(keys))

    scale = llm.engine.cache.layers[0].k[MAIN].tensor_scale.item()
    assert scale == pytest.approx(np.abs(keys).max() / 6, rel=1e-6)
    assert error(scale) < 0.8 * error(2 * scale)


def test_the_cache_counts_the_values_its_range_clips(tiny_llama):
    """Per-tensor fp4 stores magnitudes up to 6 x its tensor scale (calibrated without headroom
    on another text): the stats count the K and V values beyond that, the same count as a dense
    forward pass whose attention reads the same fake-quantized K and V
    (kvtune/runtime/clip_counter.py)."""
    policy = KVPolicy("fp4", "fp4", group_size="tensor", block_size=8)
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    tokens = random_tokens(40, seed=4)
    llm.prompt_logits(tokens)
    fmt = layer_formats(llm.arch, llm.policy)[0].k
    dense = DenseCausalAttention([len(tokens)])
    clipped = checked = 0

    def fake_quant(layer, q, k, v):
        nonlocal clipped, checked
        stored = []
        pools = llm.engine.cache.layers[layer]
        for x, pool in ((k.float(), pools.k[MAIN]), (v.float(), pools.v[MAIN])):
            clipped += int((x.abs() > 6 * pool.tensor_scale).sum())
            checked += x.numel()
            codes = quantize_ref(x, fmt, pool.tensor_scale)
            stored.append(dequantize_ref(*codes, fmt, pool.tensor_scale, x.shape[-1]))
        return dense(layer, q, *stored)

    with torch.no_grad():
        llm.model.forward(torch.tensor(tokens), torch.arange(len(tokens)), fake_quant)
    stats = llm.stats()
    assert (stats["kv_clipped_values"], stats["kv_range_checked_values"]) == (clipped, checked)
    assert clipped > 0
    group_scaled = LLM(str(tiny_llama), policy=policy.replace(group_size=16), max_model_len=64)
    group_scaled.prompt_logits(tokens)
    assert group_scaled.stats()["kv_range_checked_values"] == 0  # fp16 group scales adapt
