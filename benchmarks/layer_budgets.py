"""Per-layer selection budgets from where the exact model's attention goes when an answer is due.

Query-aware selection reads `csa_topk` older blocks (outside sinks and window) in every layer;
layers that attend locally need few of them, and the layers that retrieve need them all. For
passkey and multikey haystacks (the suite's own generator, a seed the evaluation suites do not
use) this runs the exact model (no cache, SDPA) and, at the last prompt position (where the
answer's first token is predicted), measures per layer the attention mass on older positions:
those before the window and after the sinks, in whole blocks as the cache pools them. A layer's
figure is the largest over its query heads (a KV head selects for its retrieving head), averaged
over haystacks. Budgets: --budget blocks in the layer with the most older mass, the others in
proportion to theirs, at least --floor (PyramidKV-style budgets read off the model, not set by
depth).

    .venv/bin/python -m benchmarks.layer_budgets [--contexts 3072] [--docs 4] [--seed 5]
        [--budget 80] [--floor 16] [--sinks 16] [--window 256] [--block-size 16]
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.selection_recall import task_rows
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model import DenseCausalAttention
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer


def older_mass(llm: LLM, ids: list[int], sinks: int, window: int, block_size: int) -> torch.Tensor:
    """[layers]: the largest attention mass a query head of each layer puts on older positions
    at the last position of `ids`."""
    model = llm.model
    last = len(ids) - 1
    older_end = sinks + max(0, last + 1 - sinks - window) // block_size * block_size
    masses: list[float] = []
    dense = DenseCausalAttention([len(ids)])

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(group, dim=1).float()  # [N, Hq, D]
        logits = torch.einsum("hd,nhd->hn", q[last].float(), keys) / math.sqrt(q.shape[-1])
        probs = logits.softmax(-1)
        masses.append(probs[:, sinks:older_end].sum(-1).max().item())
        return dense(layer, q, k, v)

    tokens = torch.tensor(ids)
    with torch.no_grad():
        model.forward(tokens, torch.arange(len(ids)), attention)
    return torch.tensor(masses)


def proportional_budgets(mass: torch.Tensor, budget: int, floor: int) -> list[int]:
    """`budget` blocks where the mass is largest, the others in proportion, at least floor."""
    scaled = (mass / mass.max() * budget).ceil().long().clamp(min=floor, max=budget)
    return scaled.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="3072")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--budget", type=int, default=80)
    parser.add_argument("--floor", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    folder = resolve_model("smollm2-135m")
    tokenizer = Tokenizer.from_folder(folder)
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(folder, policy=KVPolicy("auto", "auto"), max_model_len=max(contexts) + 256)
    masses = []
    for context in contexts:
        for task in ("passkey", "multikey"):
            for row in task_rows(task, context, args.docs, args.seed, tokenizer):
                ids = tokenizer.encode(row["context"])
                masses.append(older_mass(llm, ids, args.sinks, args.window, args.block_size))
    mass = torch.stack(masses).mean(0)
    budgets = proportional_budgets(mass, args.budget, args.floor)
    print("| layer | older attention mass (largest query head) | budget |")
    print("|---|---|---|")
    for layer, (m, b) in enumerate(zip(mass.tolist(), budgets, strict=True)):
        print(f"| {layer} | {m:.3f} | {b} |")
    share = sum(budgets) / (len(budgets) * args.budget)
    print(f"\nlayer_csa_topk: {budgets} ({share:.2f} of {args.budget} in every layer)")


if __name__ == "__main__":
    main()
