"""Per-layer fp32 tensor scales for quantized KV streams, measured once on a fixed text.

A live cache cannot rescale what it already wrote, so formats with one scale per tensor (fp8
per-tensor, as vLLM) or with E4M3 group scales (NVFP4-style two-level scaling) need their tensor
scale before the first write. vLLM's default is a scale of 1; kvtune measures the K and V
magnitudes of each layer on a fixed calibration conversation instead: prose, numbers and order
codes sent through the model's chat template, as a chat workload's prompts are (the template's
special tokens and the first token carry the largest keys and values). A format whose
tensor_scale is "unit" (the engines' presets, conf/policy/vllm and conf/policy/sglang) keeps the
scale 1 and skips this.

Headroom (values up to headroom x the calibrated maximum stay representable) is given where it
is free and withheld where it costs precision: E4M3 elements and E4M3 group scales keep the same
relative precision over their whole normal range, so 2x headroom only gives up part of the
subnormal range and protects against clipping; a per-tensor fp4 code has eight magnitudes, so 2x
headroom would leave the calibrated maximum at code 3 and waste the top two, and it gets none
(larger values saturate at the largest code).
"""

from __future__ import annotations

import torch

from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import KVRotation, rotate
from kvtune.runtime.kv_bytes import LayerFormats
from kvtune.runtime.model import DecoderModel, DenseCausalAttention
from kvtune.runtime.tokenizer import Tokenizer

FREE_HEADROOM = 2.0
CALIBRATION_TEXT = (
    "The cache of keys and values grows with every token a model reads. Long documents, "
    "code listings, tables of numbers such as 3.14159, 2718 and 1,000,000, conversations "
    "between a customer and an agent about order 48213-B, and questions about history, "
    "science and geography all pass through the same attention layers. "
) * 4
CALIBRATION_REPLY = "Order 48213-B shipped on 2024-03-07; the refund of $129.99 is on its way."


def calibration_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The calibration conversation as the model reads it: through its chat template when it
    has one (a user turn and an assistant reply), else the plain text."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(CALIBRATION_TEXT)
    messages = [
        {"role": "user", "content": CALIBRATION_TEXT},
        {"role": "assistant", "content": CALIBRATION_REPLY},
    ]
    return tokenizer.encode_chat(messages, add_generation_prompt=False)


def needs_tensor_scale(fmt: KVFormat) -> bool:
    """Whether a stream's tensor scale is measured: a quantized format with one scale per
    tensor or group scales relative to it (E4M3's), whose tensor scale is calibrated (not unit,
    i.e. 1)."""
    scaled_by_tensor = fmt.group_size is None or fmt.scale_format.relative_max is not None
    return fmt.quantized and scaled_by_tensor and fmt.tensor_scale == "calibrated"


def headroom(fmt: KVFormat) -> float:
    """Multiple of the calibrated maximum that stays representable (see the module docstring):
    none for per-tensor codes with few levels (fp4's), FREE_HEADROOM otherwise."""
    per_tensor_few_levels = fmt.group_size is None and fmt.element.few_levels
    return 1.0 if per_tensor_few_levels else FREE_HEADROOM


def tensor_scale(
    fmt: KVFormat, amax: float, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """The fp32 scale for a stream whose largest magnitude is amax (None: not needed)."""
    if not needs_tensor_scale(fmt):
        return None
    largest = amax * headroom(fmt)
    if fmt.group_size is None:
        value = largest / fmt.max_code
    else:  # group scales (E4M3: <= 448) must fit after dividing by the tensor scale
        value = largest / (fmt.max_code * fmt.scale_format.relative_max)
    value = max(value, torch.finfo(torch.float32).tiny)
    return torch.tensor([value], dtype=torch.float32, device=device)


class _AmaxRecorder:
    """Dense attention that also records each layer's largest |K| and |V| as cached: rotated
    first in the layers the cache rotates."""

    def __init__(self, num_tokens: int, rotations: list[KVRotation]) -> None:
        self.attention = DenseCausalAttention([num_tokens])
        self.rotations = rotations
        self.k_amax = [0.0] * len(rotations)
        self.v_amax = [0.0] * len(rotations)

    def __call__(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = self.attention(layer_index, q, k, v)
        rotation = self.rotations[layer_index]
        if rotation.keys is not None:
            k = rotate(k, rotation.keys)
        if rotation.values is not None:
            v = rotate(v, rotation.values)
        self.k_amax[layer_index] = max(self.k_amax[layer_index], float(k.abs().max()))
        self.v_amax[layer_index] = max(self.v_amax[layer_index], float(v.abs().max()))
        return out


@torch.no_grad()
def calibrate_tensor_scales(
    model: DecoderModel,
    token_ids: list[int],
    formats: list[LayerFormats],
    rotations: list[KVRotation] | None = None,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(K scale, V scale) per layer; skips the forward pass when no format needs one.
    rotations: per layer, the rotations the cache stores K and V in (None: none anywhere)."""
    if not any(needs_tensor_scale(f.k) or needs_tensor_scale(f.v) for f in formats):
        return [(None, None)] * len(formats)
    device = model.embed_tokens.weight.device
    recorder = _AmaxRecorder(len(token_ids), rotations or [KVRotation()] * len(formats))
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    model.forward(ids, torch.arange(len(token_ids), device=device), recorder)
    return [
        (tensor_scale(f.k, k_amax, device), tensor_scale(f.v, v_amax, device))
        for f, k_amax, v_amax in zip(formats, recorder.k_amax, recorder.v_amax, strict=True)
    ]
