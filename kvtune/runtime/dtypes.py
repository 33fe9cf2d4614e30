"""The compute dtype as users spell it: kvtune's fp32/fp16/bf16, vLLM's `--dtype` names and
PyTorch's (float32, half, bfloat16, torch.float16, ...), or auto (the checkpoint's own)."""

from __future__ import annotations

import torch

from kvtune.kernels.formats.element_formats import ELEMENT_FORMATS
from kvtune.kernels.formats.kv_format import TORCH_DTYPES
from kvtune.runtime.errors import ConfigError

# The compute dtypes are the registry's unquantized formats.
DTYPE_NAMES = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
# The compute dtype as kvtune, vLLM (`--dtype`) and PyTorch users write it.
DTYPE_SPELLINGS = {
    spelling: name for name in TORCH_DTYPES for spelling in (name, *ELEMENT_FORMATS[name].spellings)
}
AUTO_DTYPE = "auto"


def compute_dtype_name(
    dtype: str | torch.dtype, checkpoint_dtype: str | None = None, field: str = "dtype"
) -> str:
    """fp32 | fp16 | bf16 from any accepted spelling: a torch.dtype, "float32", "torch.half",
    "bf16", ..., or "auto" (the dtype the checkpoint declares: config.json's torch_dtype).

    Without checkpoint_dtype, "auto" is returned as is (validation before the model is found).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES:
            raise ConfigError(field, dtype, f"one of {', '.join(map(str, DTYPE_NAMES))}")
        return DTYPE_NAMES[dtype]
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else dtype
    if name == AUTO_DTYPE:
        return checkpoint_dtype or AUTO_DTYPE
    if name not in DTYPE_SPELLINGS:
        raise ConfigError(field, dtype, f"one of {', '.join([*DTYPE_SPELLINGS, AUTO_DTYPE])}")
    return DTYPE_SPELLINGS[name]
