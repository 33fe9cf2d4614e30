"""kvtune's decode step against transformers' on the same model, dtype, prompts and threads.

For each batch x context shape both engines prefill the same random prompts once (kvtune: the
engine with an fp16 KV cache (--cache: any element format, or auto for the model's fp32),
torch backend, chunked prefill; transformers: one forward on its dynamic cache (fp32, the
model's dtype) with SDPA, logits of the last position only), then take turns: --steps
decode steps of the whole batch timed on one engine, then on the other (the first engine
alternates from pair to pair), --pairs times. Each pair gives one ratio, kvtune's time per
step over transformers'; the table shows every pair's ratio, their mean and the largest
(target: <= 1.0, and <= 0.8 at 8K where attention dominates). Contexts grow by
pairs x steps tokens while timed, the same for both engines.

    .venv/bin/python -m benchmarks.runtime_cpu [--shapes 1x512,8x512,1x4096,8x4096,1x8000]
        [--cache fp16] [--pairs 6] [--steps 8] [--markdown]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from benchmarks.decoding import finish_running, start_decoding
from benchmarks.tables import print_rows
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model_source import resolve_model

MODEL = "smollm2-135m"
DEFAULT_SHAPES = "1x512,8x512,1x4096,8x4096,1x8000"  # 8K: room for the timed steps


def prompts(batch: int, context: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch * 100_000 + context)
    return torch.randint(100, vocab - 100, (batch, context), generator=generator).tolist()


def kvtune_stepper(llm: LLM, batch_prompts: list[list[int]], total_steps: int) -> Callable:
    """Prefill the batch in kvtune's engine; the returned function times `steps` decode steps
    of the whole batch (seconds)."""
    engine = llm.engine
    start_decoding(engine, batch_prompts, total_steps + 1)

    def timed(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return time.perf_counter() - started

    return timed


def transformers_stepper(model, batch_prompts: list[list[int]]) -> Callable:
    """Prefill the batch on transformers' dynamic cache; the returned function times `steps`
    single-token forwards of the whole batch (the decode loop of `generate` without its
    per-step bookkeeping)."""
    ids = torch.tensor(batch_prompts, device=model.device)
    state = {"mask": torch.ones_like(ids)}
    with torch.no_grad():
        out = model(ids, attention_mask=state["mask"], use_cache=True, logits_to_keep=1)
    state["cache"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1, True)

    @torch.no_grad()
    def timed(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            state["mask"] = torch.cat((state["mask"], torch.ones_like(state["next"])), dim=1)
            out = model(
                state["next"],
                attention_mask=state["mask"],
                past_key_values=state["cache"],
                use_cache=True,
            )
            state["cache"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1, True)
        return time.perf_counter() - started

    return timed


def paired_ratios(ours: Callable, theirs: Callable, pairs: int, steps: int) -> list[tuple]:
    """(kvtune s/step, transformers s/step) of each pair, the first engine alternating."""
    runs = []
    for pair in range(pairs):
        if pair % 2 == 0:
            mine, other = ours(steps), theirs(steps)
        else:
            other, mine = theirs(steps), ours(steps)
        runs.append((mine / steps, other / steps))
    return runs


def ratio_cells(runs: list[tuple]) -> list[str]:
    """A row's cells from paired_ratios' runs: each engine's mean ms/step, then the ratio's
    mean, its largest and every pair's."""
    ratios = [mine / other for mine, other in runs]
    return [
        f"{1000 * statistics.mean(m for m, _ in runs):.1f}",
        f"{1000 * statistics.mean(o for _, o in runs):.1f}",
        f"{statistics.mean(ratios):.2f}",
        f"{max(ratios):.2f}",
        " ".join(f"{r:.2f}" for r in ratios),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="batch x context, comma-separated")
    parser.add_argument("--cache", default="fp16", help="kvtune's K and V element format")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed a run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    longest = max(context for _, context in shapes) + args.pairs * args.steps + 2
    folder = resolve_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(
        MODEL,
        policy=KVPolicy(args.cache, args.cache),
        max_model_len=longest,
        max_num_seqs=max(batch for batch, _ in shapes),
        max_num_batched_tokens=2048,
    )
    headers = ["batch", "context", "kvtune ms/step", "transformers ms/step"]
    headers += ["ratio, mean", "ratio, largest", "every pair"]
    lines = []
    for batch, context in shapes:
        batch_prompts = prompts(batch, context, hf.config.vocab_size)
        ours = kvtune_stepper(llm, batch_prompts, args.pairs * args.steps)
        theirs = transformers_stepper(hf, batch_prompts)
        runs = paired_ratios(ours, theirs, args.pairs, args.steps)
        finish_running(llm.engine)
        lines.append([str(batch), str(context), *ratio_cells(runs)])
        print(" | ".join(lines[-1]), flush=True)
    print(
        f"kvtune ({args.cache} cache) / transformers decode step, {MODEL}, fp32, "
        f"{torch.get_num_threads()} threads, "
        f"{args.steps} steps a run, {args.pairs} pairs"
    )
    print_rows(headers, lines, args.markdown, Console())


if __name__ == "__main__":
    main()
