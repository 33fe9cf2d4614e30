"""Does a prompt position's logits depend on the tokens after it in its prefill chunk?

Prefix sharing (kvtune/autotune/evaluation/prefill_plan.py for the probability-scored tasks,
shared_generation.py for the greedy ones) reads a shorter prompt's logits from a longer
prompt's prefill. That is exact only if a position computes the same logits whichever later
tokens share its chunk. For each policy: the logits of the last 40 positions of a prefix
computed alone, against the same positions inside the whole prompt (a Wikipedia haystack):
max |logit difference| and argmax agreement, as a markdown table, for prefixes that end inside
a chunk and one that ends at a chunk boundary.

    .venv/bin/python -m benchmarks.chunk_dependence [--model smollm2-135m] [--tokens 1400]
        [--cuts 700,1000,1024]
"""

from __future__ import annotations

import argparse
import random

from kvtune.autotune.evaluation import haystack
from kvtune.runtime.llm import LLM

SPAN = 40  # positions compared before each cut
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
    print("| policy | " + " | ".join(f"cut {c}: max abs dlogit, argmax agree" for c in cuts) + " |")
    print("|---|" + "---|" * len(cuts))
    for name, policy in POLICIES.items():
        llm = base.with_policy(policy)
        results = [compare(llm, ids, cut) for cut in cuts]
        print(
            f"| {name} | "
            + " | ".join(f"{diff:.3g}, {agree:.3f}" for diff, agree in results)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
