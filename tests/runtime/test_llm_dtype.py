"""`LLM(dtype=...)` takes the compute dtype as vLLM and PyTorch users write it."""

import pytest
import torch

from kvtune.runtime.dtypes import compute_dtype_name
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.llm import LLM

SPELLINGS = [
    ("fp32", torch.float32),
    ("float32", torch.float32),
    ("float", torch.float32),
    ("torch.float32", torch.float32),
    (torch.float32, torch.float32),
    ("fp16", torch.float16),
    ("float16", torch.float16),
    ("half", torch.float16),
    ("FLOAT16", torch.float16),
    (torch.float16, torch.float16),
    ("bf16", torch.bfloat16),
    ("bfloat16", torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize(("dtype", "expected"), SPELLINGS, ids=str)
def test_every_spelling_loads_the_weights_in_that_dtype(tiny_llama, dtype, expected):
    llm = LLM(str(tiny_llama), dtype=dtype, max_model_len=64)
    assert {p.dtype for p in llm.model.parameters()} == {expected}
    assert llm.arch.dtype == {torch.float32: "fp32", torch.float16: "fp16"}.get(expected, "bf16")


def test_auto_is_the_dtype_the_checkpoint_declares(tiny_llama):
    # The tiny model is saved from a float32 model: its config.json declares float32.
    llm = LLM(str(tiny_llama), dtype="auto", max_model_len=64)
    assert {p.dtype for p in llm.model.parameters()} == {torch.float32}
    assert compute_dtype_name("auto", "bf16") == "bf16"


@pytest.mark.parametrize("dtype", ["float64", "fp8", "int8", torch.float64, ""])
def test_other_dtypes_are_refused_in_one_line_before_weights_load(tiny_llama, monkeypatch, dtype):
    from kvtune.runtime.model import DecoderModel

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before validation")

    monkeypatch.setattr(DecoderModel, "from_checkpoint", refuse)
    with pytest.raises(ConfigError) as error:
        LLM(str(tiny_llama), dtype=dtype, max_model_len=64)
    assert error.value.field == "dtype"
    assert "float32" in str(error.value) and "\n" not in str(error.value)
