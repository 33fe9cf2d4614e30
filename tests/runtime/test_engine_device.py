"""The engine on the GPU (KVTUNE_TEST_DEVICE=cuda, benchmarks/gpu_check.sh): the Triton
backends there against the torch backend on the CPU, with a tolerance named by the precision of
the kernels' dot products.

- ieee (`triton`): the CPU interpreter's bound (tests/runtime/test_engine.py): 1e-4 relative
  error in the prompt logits, and the same greedy tokens.
- tf32 (`triton_tf32`): attention outputs carry up to ~5e-4 relative error a layer
  (tests/kernels/attention/test_attention_precision.py), so 5e-3 in the logits; tokens may differ.

On the CPU these cases are test_engine.py's (the interpreter has no tf32), so they run on CUDA
only.
"""

from __future__ import annotations

import pytest

from kvtune.runtime import LLM
from kvtune.runtime.policy import KVPolicy
from tests.conftest import TEST_DEVICE
from tests.runtime.test_engine import SELECTING, TRITON_POLICIES, random_tokens, relative_error

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda", reason="KVTUNE_TEST_DEVICE=cuda only")

LOGITS_TOLERANCE = {"triton": 1e-4, "triton_tf32": 5e-3}
POLICIES = {
    "fp16": KVPolicy("fp16", "fp16", block_size=8, chunk_size=16),
    "fp8-fp4-csa": TRITON_POLICIES[0],
    # Selection: the host tier in pinned host memory, scratch copies for prefill, fetches for
    # decode.
    "fp8-csa-select": SELECTING,
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("backend", LOGITS_TOLERANCE)
def test_triton_on_the_device_agrees_with_torch_on_cpu(tiny_llama, backend, policy):
    tokens = random_tokens(40, seed=3)
    cpu = LLM(str(tiny_llama), policy=policy, max_model_len=64)
    gpu = LLM(str(tiny_llama), policy=policy, backend=backend, device="cuda", max_model_len=64)
    assert gpu.engine.device.type == "cuda"
    error = relative_error(gpu.prompt_logits(tokens), cpu.prompt_logits(tokens))
    assert error < LOGITS_TOLERANCE[backend]
    if backend == "triton":
        expected = cpu.generate([tokens[:20]], 6)[0].token_ids
        assert gpu.generate([tokens[:20]], 6)[0].token_ids == expected
