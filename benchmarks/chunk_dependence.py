"""Does a prompt position's logits depend on the tokens after it in its prefill chunk?

Prefix sharing (kvtune/autotune/evaluation/prefill_plan.py for the probability-scored tasks,
shared_generation.py for the greedy ones) reads a shorter prompt's logits from a longer
prompt's prefill. That is exact only if a position computes the same logits whichever later
tokens share its chunk. For each policy: the logits of the last 40 positions of a prefix
computed alone, against the same positions inside the whole prompt (a Wikipedia haystack):
max |logit difference| and argmax agreement, as a markdown table, for prefixes that end inside
a chunk and one that ends at a chunk boundary; and, as a control, the whole prompt against
itself with every key and value the model writes scaled by (1 + 1e-7 noise): an fp32 rounding's
size, at equal shapes. Where the control moves the logits as much, the dependence is the
cache's sensitivity to rounding (codes on a boundary flip and the layers amplify the flips),
not a read of later tokens.

    .venv/bin/python -m benchmarks.chunk_dependence [--model smollm2-135m] [--tokens 1400]
        [--cuts 700,1000,1024]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvtune.autotune.evaluation import haystack
from kvtune.runtime.llm import LLM

SPAN = 40  # positions compared before each cut
NOISE = 1e-7  # the control's relative perturbation of K and V: fp32 rounding's size
POLICIES: dict[str, dict] = {
    "auto (model dtype)": {"k_dtype": "auto", "v_dtype": "auto"},
    "int4 g32": {"k_dtype": "int4", "v_dtype": "int4", "group_size": 32},
    "fp4 g16": {"k_dtype": "fp4", "v_dtype": "fp4", "group_size": 16},
    "int4 K channel b16 / V g16": {
        "k_dtype": "int4",
        "v_dtype": "int4",
        "group_size": 16,
        "k_scale_axis": "channel",
    },
    "int4 g32 + recent 128": {
        "k_dtype": "int4",
        "v_dtype": "int4",
        "group_size": 32,
        "recent_unquantized": 128,
    },
}


def haystack_ids(llm: LLM, tokens: int) -> list[int]:
    """`tokens` token ids of Wikipedia prose (seeded)."""

    def count(text: str) -> int:
        return len(llm.tokenizer.encode(text, add_special_tokens=False))

    paragraphs = haystack.fill(
        random.Random(0), haystack.haystack_paragraphs(), tokens + 100, count
    )
    return llm.tokenizer.encode("\n\n".join(paragraphs))[:tokens]


def compare(llm: LLM, ids: list[int], cut: int) -> tuple[float, float]:
    """(max |logit difference|, argmax agreement) of positions cut-SPAN..cut-1 alone vs inside."""
    by_itself = llm.prompt_logits_batch([ids[:cut]], [cut - SPAN])[0]
    inside = llm.prompt_logits_batch([ids], [cut - SPAN])[0][:SPAN]
    difference = float((by_itself - inside).abs().max())
    agreement = float((by_itself.argmax(-1) == inside.argmax(-1)).float().mean())
    return difference, agreement


@contextmanager
def perturbed_writes(llm: LLM) -> Iterator[None]:
    """Every K and V the model writes scaled by (1 + NOISE * a seeded normal draw)."""
    cache = llm.engine.cache
    attend = cache.attend

    def perturbed(layer, layout, q, k, v, scale):
        draws = torch.Generator().manual_seed(layer)
        k = k * (1 + NOISE * torch.randn(k.shape, generator=draws, dtype=k.dtype))
        v = v * (1 + NOISE * torch.randn(v.shape, generator=draws, dtype=v.dtype))
        return attend(layer, layout, q, k, v, scale)

    cache.attend = perturbed
    try:
        yield
    finally:
        del cache.attend


def control(llm: LLM, ids: list[int]) -> tuple[float, float]:
    """(max |logit difference|, argmax agreement) of the whole prompt against itself with
    perturbed writes, over its last SPAN positions."""
    start = len(ids) - SPAN
    exact = llm.prompt_logits_batch([ids], [start])[0]
    with perturbed_writes(llm):
        perturbed = llm.prompt_logits_batch([ids], [start])[0]
    difference = float((exact - perturbed).abs().max())
    return difference, float((exact.argmax(-1) == perturbed.argmax(-1)).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1400)
    parser.add_argument("--cuts", default="700,1000,1024")
    args = parser.parse_args()
    cuts = [int(c) for c in args.cuts.split(",")]
    base = LLM(args.model, max_num_seqs=2, max_model_len=args.tokens)
    ids = haystack_ids(base, args.tokens)
    print(f"{args.model}, {args.tokens}-token prompt, chunk {base.policy.chunk_size}\n")
    columns = [f"cut {c}: max abs dlogit, argmax agree" for c in cuts]
    print("| policy | " + " | ".join([*columns, f"control: K/V x (1 + {NOISE:g} noise)"]) + " |")
    print("|---|" + "---|" * (len(cuts) + 1))
    for name, policy in POLICIES.items():
        llm = base.with_policy(policy)
        results = [compare(llm, ids, cut) for cut in cuts] + [control(llm, ids)]
        print(
            f"| {name} | "
            + " | ".join(f"{diff:.3g}, {agree:.3f}" for diff, agree in results)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
