"""kvtune's runtime against transformers on the same model, dtype and thread count.

Decode tokens/s at batch 1 and 8 for contexts 512 and 2048, and prefill tokens/s, for the
kvtune engine (torch backend, `auto` KV cache, chunked prefill) and for transformers'
`generate` (dynamic cache, SDPA). Timings are medians of --repeats runs in this one process;
the table reports kvtune / transformers ratios (target >= 1.0).

    .venv/bin/python -m benchmarks.runtime_cpu [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model_source import resolve_model

MODEL = "smollm2-135m"


def prompts(batch: int, context: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch * 100_000 + context)
    return torch.randint(100, vocab - 100, (batch, context), generator=generator).tolist()


def median_seconds(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def kvtune_times(llm: LLM, batch_prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds for prefill + first token, seconds for prefill + new_tokens)."""

    def generate(n: int):
        def run():
            results = llm.generate(batch_prompts, max_new_tokens=n)
            assert all(len(r.token_ids) == n for r in results), "stopped early"

        return run

    return median_seconds(generate(1), repeats), median_seconds(generate(new_tokens), repeats)


def transformers_times(model, batch_prompts, new_tokens: int, repeats: int) -> tuple[float, float]:
    ids = torch.tensor(batch_prompts, device=model.device)
    mask = torch.ones_like(ids)

    def generate(n: int):
        def run():
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        return run

    return median_seconds(generate(1), repeats), median_seconds(generate(new_tokens), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    new_tokens, repeats = (9, 1) if args.quick else (args.new_tokens, args.repeats)
    shapes = [(1, 512), (8, 512), (1, 2048), (8, 2048)]

    folder = resolve_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    llm = LLM(
        MODEL,
        policy=KVPolicy("auto", "auto"),
        device=args.device,
        max_model_len=2048 + 64,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
    )
    table = Table(
        title=f"kvtune vs transformers, {MODEL}, fp32, {args.device}, "
        f"{torch.get_num_threads()} threads, {new_tokens} new tokens, median of {repeats}"
    )
    for column in (
        "batch",
        "context",
        "prefill tok/s kvtune",
        "prefill tok/s hf",
        "ratio",
        "decode tok/s kvtune",
        "decode tok/s hf",
        "ratio",
    ):
        table.add_column(column, justify="right")
    for batch, context in shapes:
        batch_prompts = prompts(batch, context, hf.config.vocab_size)
        ours = kvtune_times(llm, batch_prompts, new_tokens, repeats)
        theirs = transformers_times(hf, batch_prompts, new_tokens, repeats)
        prefill = [batch * context / t[0] for t in (ours, theirs)]
        decode = [batch * (new_tokens - 1) / (t[1] - t[0]) for t in (ours, theirs)]
        table.add_row(
            str(batch),
            str(context),
            f"{prefill[0]:.0f}",
            f"{prefill[1]:.0f}",
            f"{prefill[0] / prefill[1]:.2f}",
            f"{decode[0]:.1f}",
            f"{decode[1]:.1f}",
            f"{decode[0] / decode[1]:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
