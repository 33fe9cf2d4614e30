"""Bringing an engine's requests to decode, and clearing them: what the decode timings share."""

from __future__ import annotations

from collections.abc import Sequence

from kvtune.runtime.engine import Engine


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
