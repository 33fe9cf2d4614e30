"""Bringing an engine's requests to decode, and clearing them: what the decode timings share."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvtune.runtime.engine import Engine


def random_prompts(context: int, batch: int) -> list[list[int]]:
    """`batch` prompts of `context` random ids (seed 0): the same prompts in every engine timed."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(100, 20_000, (context,), generator=generator).tolist() for _ in range(batch)
    ]


def start_decoding(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Add every prompt and step until each has its first token, so that from then on a step
    decodes them all. Early prompts decode while later ones prefill: max_new_tokens needs
    headroom beyond the steps the caller times."""
    for prompt in prompts:
        engine.add_request(list(prompt), max_new_tokens=max_new_tokens)
    while sum(bool(seq.output_ids) for seq in engine.scheduler.running) < len(prompts):
        engine.step()


def finish_running(engine: Engine) -> None:
    """End every running request (the timed steps are taken; the engine is reused)."""
    for seq in list(engine.scheduler.running):
        engine.scheduler.finish(seq)


def paired_medians(engines: Sequence[Engine], steps: int) -> list[float]:
    """Median seconds of a decode step of each engine over `steps` steps taken in turns, so
    that a shared machine's load drifts into every median alike."""
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for engine, taken in zip(engines, times, strict=True):
            started = time.perf_counter()
            engine.step()
            taken.append(time.perf_counter() - started)
    return [sorted(taken)[len(taken) // 2] for taken in times]
