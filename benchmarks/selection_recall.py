"""How often CSA selection reads the pass key's block when the answer is due, by context length.

For passkey haystacks (the suite's own generator) at each --contexts length, one prefill of the
prompt through the policy's cache; at its last position (where the answer's first token is
predicted) each layer and KV head selects --policy's csa_topk older blocks. This reports the
share of (layer, KV head) pairs whose selection holds every block with a digit of the key, per
haystack and by layer. It is a probe of the runtime's own choice: the selection function the
cache calls is wrapped to record its result, not replaced.

    .venv/bin/python -m benchmarks.selection_recall [--contexts 3072,7168] [--docs 3]
        [--policy "int4 K channel / V rotated w256 + top80 host no summaries int4 index"]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import kvtune.runtime.block_selection as block_selection
from benchmarks.compression import POLICIES
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import generate_rows
from kvtune.runtime import LLM
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer


@contextmanager
def recorded_selections() -> Iterator[list[torch.Tensor]]:
    """Each select_blocks call's choice for the last query of its step ([KV heads, blocks])."""
    calls: list[torch.Tensor] = []
    select = block_selection.select_blocks

    def recording(*args, **kwargs):
        chosen = select(*args, **kwargs)
        calls.append(chosen[-1].clone())
        return chosen

    block_selection.select_blocks = recording
    try:
        yield calls
    finally:
        block_selection.select_blocks = select


def key_blocks(text: str, key: str, tokenizer: Tokenizer, sinks: int, block_size: int) -> range:
    """Older-block indices (counted after the sinks) holding a token of the key's digits (their
    first occurrence: the needle's, as the question and its answer prefix hold no digits)."""
    first = text.index(key)
    start = len(tokenizer.encode(text[:first]))
    end = len(tokenizer.encode(text[: first + len(key)]))
    return range((start - sinks) // block_size, (end - 1 - sinks) // block_size + 1)


def task_rows(
    task: str, context: int, docs: int, seed: int, tokenizer: Tokenizer, questions: int = 1
) -> list[dict]:
    """The suite's rows of a needle task (passkey or multikey) at `context` tokens (rows with
    context, answer, depth; a multikey document gives one row per question)."""
    suite = EvalSuite.from_dict(
        {
            "name": f"{task}-probe",
            "seed": seed,
            "context_tokens": context,
            "tasks": {task: {"docs": docs, "questions": questions}},
        }
    )
    return generate_rows(suite, tokenizer)[task]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="3072,7168")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--policy", default="int4 K channel / V rotated w256 + top80 host no summaries int4 index"
    )
    args = parser.parse_args()
    if args.policy not in POLICIES:
        parser.error(f"--policy: unknown {args.policy!r}; known: {', '.join(POLICIES)}")
    policy = POLICIES[args.policy]
    if not policy.selects:
        parser.error(f"--policy: {args.policy!r} selects no blocks (csa_topk 0)")
    folder = resolve_model("smollm2-135m")
    tokenizer = Tokenizer.from_folder(folder)
    llm = LLM(folder, policy=policy, max_model_len=8192, max_num_seqs=1)
    num_layers = llm.engine.arch.num_layers
    print(
        "| context | key depth | key block / older blocks | share of (layer, KV head) pairs "
        "reading it | KV heads reading it, layer by layer |"
    )
    print("|---|---|---|---|---|")
    for context in [int(c) for c in args.contexts.split(",")]:
        for row in task_rows("passkey", context, args.docs, args.seed, tokenizer):
            text, key = row["context"], row["answer"]
            blocks = key_blocks(text, key, tokenizer, policy.csa_sinks, policy.block_size)
            with recorded_selections() as calls:
                llm.prompt_logits(tokenizer.encode(text))
            per_layer = torch.stack(calls[-num_layers:])  # the last step: one call a layer
            hits = per_layer[:, :, list(blocks)].all(-1).float()  # [layers, KV heads]
            by_layer = "".join(str(int(n)) for n in hits.sum(1).tolist())
            print(
                f"| {context} | {row['depth']:.2f} | {blocks.start}/{per_layer.shape[-1]} | "
                f"{hits.mean():.2f} | {by_layer} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
