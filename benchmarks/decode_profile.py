"""Where a decode step's attention time goes: fp16 against a selecting CSA policy, stage by stage.

    python -m benchmarks.decode_profile [--policy NAME] [--context 4096] [--steps 24] [--batch 1]

The engines decode the same random prompts and step in turns (as `benchmarks.compression`
times them); every stage below is timed by wrapping the runtime's own functions for the run:
the KV cache's attend (all of a layer's cache work), the attention call, the cache write, the
maintenance copies, block scoring and choice (select_blocks), the host-tier fetch, and the
rotations of queries, keys, values and outputs. Prints milliseconds per step (medians of the
step totals; stage times are means, summed over layers) and the torch operator calls of one
more step under the profiler (calls made from Python, each stage counting those inside it): on
a CPU a selecting step is bound by calls, not bytes, and the counts do not drift with the
machine's load as times do.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from rich.console import Console

import kvtune.runtime.block_selection as block_selection
import kvtune.runtime.kv_cache as kv_cache
from benchmarks.compression import DECODE_HEADROOM, POLICIES
from benchmarks.decoding import finish_running, random_prompts, start_decoding
from benchmarks.tables import print_rows
from kvtune.runtime.host_fetch import HostFetch
from kvtune.runtime.llm import LLM
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy

DEFAULT_POLICY = "int4 K channel / V rotated w256 + top80 host no summaries int4 index"
FP16 = KVPolicy("fp16", "fp16")
# (stage, owner, attribute): what each stage wraps.
STAGES = [
    ("cache work (attend)", kv_cache.KVCache, "attend"),
    ("  attention", None, "attention"),
    ("  cache write", None, "write_kv"),
    ("  maintenance copies", kv_cache.KVCache, "_run_copies"),
    ("  block scoring and choice", block_selection, "select_blocks"),
    ("  host-tier fetch", HostFetch, "fetch"),
    ("  rotations", kv_cache, "rotate"),
    ("  rotations", kv_cache, "rotate_queries"),
    ("  rotations", kv_cache, "unrotate"),
]
# The profiler range name of a stage call, in the step whose operator calls are counted.
STAGE_MARK = "stage: "


class StageClock:
    """Seconds spent in each stage, per engine label, while `label` names the stepping engine;
    with `marking`, each stage call is also a profiler range named STAGE_MARK + stage."""

    def __init__(self) -> None:
        self.label = ""
        self.marking = False
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)

    def timed(self, stage: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.marking:
                with torch.profiler.record_function(STAGE_MARK + stage):
                    return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[(self.label, stage)] += time.perf_counter() - started

        return wrapper


def operator_calls(run: LLM, clock: StageClock) -> dict[str, int]:
    """Torch operator calls made from Python in one step of run (those an operator makes
    inside itself are not counted), in all ("step") and within each stage."""
    clock.marking = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run.engine.step()
    finally:
        clock.marking = False
    calls: dict[str, int] = defaultdict(int)
    for event in prof.events():
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (
            parent is not None and parent.name.startswith("aten::")
        ):
            continue
        calls["step"] += 1
        stages = set()
        while parent is not None:
            if parent.name.startswith(STAGE_MARK):
                stages.add(parent.name.removeprefix(STAGE_MARK))
            parent = parent.cpu_parent
        for stage in stages:
            calls[stage] += 1
    return calls


@contextmanager
def wrapped(clock: StageClock, engines: list[LLM]) -> Iterator[None]:
    """Every stage of STAGES timed by clock, restored afterwards."""
    saved = []
    for stage, owner, name in STAGES:
        if owner is None:  # a backend op: each engine's cache holds its own CacheOps
            continue
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, clock.timed(stage, getattr(owner, name)))
    ops = [llm.engine.cache.ops for llm in engines]
    for llm in engines:
        cache = llm.engine.cache
        timed = {
            name: clock.timed(stage, getattr(cache.ops, name))
            for stage, owner, name in STAGES
            if owner is None
        }
        cache.ops = dataclasses.replace(cache.ops, **timed)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        for llm, original_ops in zip(engines, ops, strict=True):
            llm.engine.cache.ops = original_ops


def profile(
    runs: dict[str, LLM], context: int, steps: int, batch: int
) -> tuple[dict[str, float], dict[tuple[str, str], float], dict[str, dict[str, int]]]:
    """(median step ms per label, stage ms per step per (label, stage)) over `steps` steps of
    each engine of runs (by label), and each label's operator calls in one more step
    (`operator_calls`)."""
    prompts = random_prompts(context, batch)
    for run in runs.values():
        start_decoding(run.engine, prompts, DECODE_HEADROOM)
    clock = StageClock()
    totals: dict[str, list[float]] = defaultdict(list)
    with wrapped(clock, list(runs.values())):
        for _ in range(steps):
            for label, run in runs.items():
                clock.label = label
                started = time.perf_counter()
                run.engine.step()
                totals[label].append(time.perf_counter() - started)
        calls = {label: operator_calls(run, clock) for label, run in runs.items()}
    for run in runs.values():
        finish_running(run.engine)
    medians = {label: sorted(t)[len(t) // 2] * 1000 for label, t in totals.items()}
    stages = {key: seconds * 1000 / steps for key, seconds in clock.seconds.items()}
    return medians, stages, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="a benchmarks.compression row")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.policy not in POLICIES:
        parser.error(f"--policy: unknown {args.policy!r}; known: {', '.join(POLICIES)}")
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch: allowed: positive counts")
    length = args.context + DECODE_HEADROOM + 8
    base = LLM(
        resolve_model("smollm2-135m"), policy=FP16, max_model_len=length, max_num_seqs=args.batch
    )
    runs = {"fp16": base, "policy": base.with_policy(POLICIES[args.policy])}
    medians, stages, calls = profile(runs, args.context, args.steps, args.batch)
    labels = tuple(runs)
    rows = [
        [
            "step (median)",
            *(f"{medians[label]:.1f}" for label in labels),
            *(str(calls[label]["step"]) for label in labels),
        ]
    ]
    for stage in dict.fromkeys(stage for stage, _, _ in STAGES):
        rows.append(
            [
                stage,
                *(f"{stages.get((label, stage), 0.0):.1f}" for label in labels),
                *(str(calls[label].get(stage, 0)) for label in labels),
            ]
        )
    headers = ["a step", *(f"{label} ms" for label in labels)]
    headers += [f"{label} calls" for label in labels]
    print_rows(headers, rows, args.markdown, Console())
    print(f"policy: {args.policy}")
    for label in labels[1:]:
        print(f"{label} step / fp16 step: {medians[label] / medians['fp16']:.2f}")


if __name__ == "__main__":
    main()
