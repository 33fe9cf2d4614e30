"""Why per-token key codes lose on a model: how Gaussian its rotated unit keys are, and how much of
a key is the per-channel mean that every token shares (it shifts all logits of a query equally,
so softmax ignores it, yet a per-token code spends its precision on it).

Prints, averaged over layers, for the post-RoPE keys of a fixed text: the share of rotated unit
coordinates beyond the outer level of the 3-bit Lloyd-Max codebook (a Gaussian gives 3.2%), the
mean |first rotated coordinate| (where the all-ones Hadamard column gathers a common offset),
and |k - mean over tokens of k| / |k|.

    .venv/bin/python -m benchmarks.key_structure [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from kvtune.kernels.formats.lloyd_max import levels
from kvtune.kernels.formats.rotation import hadamard_matrix
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model import DenseCausalAttention

TEXT = (
    "The history of the river begins in the mountains, where snow melts each spring and feeds "
    "the streams that run down into the valley. "
) * 6
TOKENS = 400


def layer_keys(model: str) -> dict[int, torch.Tensor]:
    """Post-RoPE keys [tokens, KV heads, head_dim] of every layer for TEXT (exact cache)."""
    llm = LLM(model, policy=KVPolicy("auto", "auto"), max_model_len=512)
    ids = llm.tokenizer.encode(TEXT)[:TOKENS]
    dense = DenseCausalAttention([len(ids)])
    keys: dict[int, torch.Tensor] = {}

    def capture(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys[layer] = k.detach().float()
        return dense(layer, q, k, v)

    with torch.no_grad():
        llm.model.forward(torch.tensor(ids), torch.arange(len(ids)), capture)
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    keys = layer_keys(args.model)
    head_dim = next(iter(keys.values())).shape[-1]
    rotation = hadamard_matrix(head_dim) / math.sqrt(head_dim)
    outer = levels(head_dim, 3)[-1].item()
    beyond, first, centred = [], [], []
    for k in keys.values():
        rotated = (k / k.norm(dim=-1, keepdim=True)) @ rotation
        beyond.append((rotated.abs() > outer).float().mean().item())
        first.append(rotated[..., 0].abs().mean().item())
        shared = k.mean(dim=0, keepdim=True)
        centred.append(((k - shared).norm(dim=-1) / k.norm(dim=-1)).mean().item())
    print(f"layers: {len(keys)}, head_dim {head_dim}, 3-bit outer level {outer:.3f}")
    print(f"rotated unit coordinates beyond it: {statistics.mean(beyond):.1%}")
    print(f"mean |first rotated coordinate|: {statistics.mean(first):.3f}")
    print(
        f"|k - token mean| / |k|: mean {statistics.mean(centred):.3f}, "
        f"range {min(centred):.3f}-{max(centred):.3f}"
    )


if __name__ == "__main__":
    main()
