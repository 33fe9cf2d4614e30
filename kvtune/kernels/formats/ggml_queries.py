"""llama.cpp rounds each query before it meets a quantized K cache; kvtune does the same.

llama.cpp's flash attention converts a query row to its K type's dot-product type before q.k
(ggml-cpu ops.cpp, flash_attn_ext one-chunk path: `q_to_vec_dot(pq, Q_q, DK)` with the K
type's `vec_dot_type`). Every quantized cache type it accepts dots with 8-bit queries: q8_0
for q8_0, q4_0, q5_0 and iq4_nl, q8_1 for q4_1 and q5_1, whose codes and scale are q8_0's (q8_1
adds the block sum, which only speeds up the dot). The rounding is part of what a llama.cpp user
gets from a quantized cache, so a layer whose keys are a ggml type (`ElementFormat.ggml_block`)
attends with queries rounded to q8_0 blocks of 32 along head_dim, after any rotation, in prefill
and decode alike. f16 and bf16 keys, and every other format, leave queries as they are.
"""

from __future__ import annotations

import torch

from kvtune.kernels.formats.ggml_codes import GGML_BLOCK
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref

QUERY_FORMAT = KVFormat("q8_0", GGML_BLOCK, "fp16", tensor_scale="unit")


def round_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries [..., D] as llama.cpp's q8_0 rounds them, in q's dtype."""
    codes, scales = quantize_ref(q, QUERY_FORMAT)
    return dequantize_ref(codes, scales, QUERY_FORMAT, None, q.shape[-1]).to(q.dtype)
