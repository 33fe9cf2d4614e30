"""The engine presets (conf/policy/vllm, conf/policy/sglang, conf/policy/llamacpp) run in the
engine: the Triton backend agrees with the torch backend, the tensor scale stays 1 (no
calibration, as the engines without checkpoint scales), held bytes equal the planner's, and the
logits stay near the exact cache's. llama.cpp's run on a model whose heads its rotation reaches
(head_dim 128)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvtune.runtime import LLM
from kvtune.runtime.kv_bytes import kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from tests.runtime.test_engine import random_tokens, relative_error

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESETS = sorted(
    f"{path.parent.name}/{path.stem}"
    for engine in ("vllm", "sglang", "llamacpp")
    for path in (CONF / "policy" / engine).glob("*.yaml")
)
TINY_HEAD_DIM = 32  # tests/runtime/conftest.py
# The tiny models by head_dim (tests/runtime/conftest.py), and the one each engine's presets run on.
TINY_MODELS = {32: "tiny_llama", 128: "tiny_llama_head_dim_128"}
ENGINE_HEAD_DIM = {"llamacpp": 128}


def tiny_preset(name: str, head_dim: int = TINY_HEAD_DIM) -> KVPolicy:
    """The preset as Hydra composes it for the tiny model's head_dim (a one-group-per-vector
    preset takes group_size = model.head_dim), on small blocks. The two-layer model would keep
    both layers exact under TurboQuant's boundary layers, so they are turned off here to run
    its codes (test_turboquant_boundary_layers_stay_exact covers them)."""
    overrides = [f"policy={name}", f"model.head_dim={head_dim}"]
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("plan", overrides=overrides)
    policy = KVPolicy.from_dict(dict(cfg.policy))
    return policy.replace(block_size=8, chunk_size=16, boundary_layers=0)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_alike_on_both_backends_with_unit_tensor_scales(request, name):
    head_dim = ENGINE_HEAD_DIM.get(name.split("/")[0], TINY_HEAD_DIM)
    tiny_llama = request.getfixturevalue(TINY_MODELS[head_dim])
    policy = tiny_preset(name, head_dim)
    tokens = random_tokens(40, seed=3)
    torch_llm = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    for layer in torch_llm.engine.cache.layers:
        assert float(layer.k[MAIN].tensor_scale) == float(layer.v[MAIN].tensor_scale) == 1.0
    reference = torch_llm.prompt_logits(tokens)
    exact = LLM(str(tiny_llama), policy=KVPolicy("auto", "auto"), max_model_len=64)
    assert relative_error(reference, exact.prompt_logits(tokens)) < 0.2
    triton = LLM(str(tiny_llama), policy=policy, backend="triton", max_model_len=64)
    assert relative_error(triton.prompt_logits(tokens), reference) < 1e-4
    engine = triton.engine
    engine.add_request(tokens[:20], max_new_tokens=4)
    while engine.scheduler.has_work:
        engine.step()
        for seq in engine.scheduler.running:
            held = engine._held_bytes(engine.scheduler.kv[seq.seq_id])
            assert held == kv_bytes_per_sequence(triton.arch, policy, seq.num_cached)


def test_turboquant_boundary_layers_stay_exact(tiny_llama):
    """vLLM keeps the first and last min(2, L // 2) layers in the model dtype: on the two-layer
    model both layers hold fp16 and the logits are the fp16 cache's."""
    policy = tiny_preset("vllm/turboquant_3bit_nc").replace(boundary_layers=2)
    tokens = random_tokens(40, seed=3)
    cache = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    fp16 = LLM(str(tiny_llama), policy=KVPolicy("fp16", "fp16"), max_model_len=64)
    assert all(layer.k[MAIN].fmt.dtype == "fp16" for layer in cache.engine.cache.layers)
    assert relative_error(cache.prompt_logits(tokens), fp16.prompt_logits(tokens)) < 1e-6
