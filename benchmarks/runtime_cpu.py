"""kvtune's runtime against transformers on the same model, dtype and thread count.

Prefill and decode tokens/s at batch 1 and 8 for contexts 512 and 2048, for the kvtune engine
(torch backend, `auto` KV cache, chunked prefill) and for transformers (dynamic cache, SDPA).
Prefill: `generate` of one token. Decode: `--steps` steps of the whole batch timed on their
own after its prefill (kvtune: engine steps with every sequence decoding; transformers:
single-token forwards on its cache, the loop inside `generate`). Timings are medians of
--repeats runs in this one process; the table reports kvtune / transformers ratios (target
>= 1.0).

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

from benchmarks.decoding import finish_running, start_decoding
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model_source import resolve_model

MODEL = "smollm2-135m"
DECODE_HEADROOM = 32  # tokens a sequence may decode beyond the timed steps


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


def kvtune_times(llm: LLM, batch_prompts, steps: int, repeats: int) -> tuple[float, float]:
    """(seconds of prefill + first token, seconds of `steps` decode steps of the whole batch)."""

    def prefill():
        results = llm.generate(batch_prompts, max_new_tokens=1)
        assert all(len(r.token_ids) == 1 for r in results), "stopped early"

    def decode() -> float:
        engine = llm.engine
        start_decoding(engine, batch_prompts, steps + DECODE_HEADROOM)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - started
        finish_running(engine)
        return elapsed

    return median_seconds(prefill, repeats), statistics.median(decode() for _ in range(repeats))


def transformers_times(model, batch_prompts, steps: int, repeats: int) -> tuple[float, float]:
    """(seconds of `generate` for one token, seconds of `steps` single-token forwards on its
    dynamic cache: the decode loop of `generate` without its per-step bookkeeping)."""
    ids = torch.tensor(batch_prompts, device=model.device)
    mask = torch.ones_like(ids)

    def prefill():
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0
            )

    @torch.no_grad()
    def decode() -> float:
        out = model(ids, attention_mask=mask, use_cache=True)
        cache, attention_mask = out.past_key_values, mask
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for _ in range(steps):
            attention_mask = torch.cat((attention_mask, torch.ones_like(next_ids)), dim=1)
            out = model(
                next_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True
            )
            cache, next_ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - started

    return median_seconds(prefill, repeats), statistics.median(decode() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps, repeats = (8, 1) if args.quick else (args.steps, args.repeats)
    shapes = [(1, 512), (8, 512), (1, 2048), (8, 2048)]

    folder = resolve_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    llm = LLM(
        MODEL,
        policy=KVPolicy("auto", "auto"),
        device=args.device,
        max_model_len=2048 + steps + DECODE_HEADROOM,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
    )
    table = Table(
        title=f"kvtune vs transformers, {MODEL}, fp32, {args.device}, "
        f"{torch.get_num_threads()} threads, {steps} decode steps, median of {repeats}"
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
        ours = kvtune_times(llm, batch_prompts, steps, repeats)
        theirs = transformers_times(hf, batch_prompts, steps, repeats)
        prefill = [batch * context / t[0] for t in (ours, theirs)]
        decode = [batch * steps / t[1] for t in (ours, theirs)]
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
