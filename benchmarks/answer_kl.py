"""Where a policy's answer goes wrong: the KL from fp16 at each teacher-forced answer token.

Retention sums each answer's per-token KL (kvtune.autotune.evaluation.scoring), so a policy
that finds the needle's block for the first digit and loses it for the third shows only as a
low task score. This prints, for each question of a needle task (the suite's generator,
--questions a document as in the held-out suite), the KL(fp16 || policy) of the next-token
distribution at every answer token and their sum, policy beside policy.

    .venv/bin/python -m benchmarks.answer_kl [--task multikey] [--context 3072] [--docs 3]
        [--questions 4] [--seed 1] [--policies "..."]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.compression import FP16, POLICIES
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import generate_rows
from kvtune.runtime import LLM
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer


def answer_log_probs(llm: LLM, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log-softmax [len(answer), vocab] of the next token at each teacher-forced answer token."""
    logits = llm.prompt_logits(prompt + answer)
    return logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].log_softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="multikey", choices=["passkey", "multikey", "codes"])
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--policies",
        default="int4 K channel / V rotated w128 + top40 host no summaries int4 index,"
        "int4 K channel / V rotated w128 + top40 host no summaries int4 means",
        help="comma-separated names from benchmarks.compression",
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    folder = resolve_model("smollm2-135m")
    tokenizer = Tokenizer.from_folder(folder)
    task = {"docs": args.docs, "questions": args.questions}
    suite = EvalSuite.from_dict(
        {
            "name": "answer-kl",
            "seed": args.seed,
            "context_tokens": args.context,
            "tasks": {args.task: task},
        }
    )
    base = LLM(folder, policy=FP16, max_model_len=args.context + 512, max_num_seqs=1)
    llms = [base.with_policy(POLICIES[name]) for name in names]
    print(
        "| doc | turn | answer depth | "
        + " | ".join(f"{n}: KL per answer token (sum)" for n in names)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(names))
    for row in generate_rows(suite, tokenizer)[args.task]:
        prompt = tokenizer.encode(row["context"])
        answer = tokenizer.encode(row["context"] + row["answer"])[len(prompt) :]
        reference = answer_log_probs(base, prompt, answer)
        cells = []
        for llm in llms:
            kl = (reference.exp() * (reference - answer_log_probs(llm, prompt, answer))).sum(-1)
            cells.append(" ".join(f"{x:.2f}" for x in kl.tolist()) + f" ({kl.sum():.2f})")
        print(
            f"| {row['doc']} | {row['turn']} | {row['depth']:.2f} | " + " | ".join(cells) + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
