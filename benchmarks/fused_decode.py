"""The fused CPU decode kernel against the torch path it replaces, in one run (issue 41 item 1).

Two timings, each a ratio fused / torch path of paired runs, their calls taken in turns (the
order swapped every call, after one discarded call of each side), so that a shared machine's
load drifts into both sides alike; every run's ratio is shown with their mean:
- op: one layer's decode attention in SmolLM2-135M's shapes (9 query heads over 3 KV heads,
  head_dim 64, the policy's block size) over one stream of random vectors stored in the K and
  V formats of the policy's layers: `decode_attention_native` against `decode_attention_torch`
  (the native block reader into an fp32 buffer, then SDPA). A run times as many calls a side
  as take about --seconds on the torch path (at most --calls).
- step: a whole engine decode step of SmolLM2-135M (30 layers, fp32 compute, torch backend)
  under the policy, every sequence decoding after its own prompt of the context's length, with
  the kernel on against KVTUNE_NATIVE_OFF=decode_attention (the torch path, every other native
  kernel on). A run times --steps steps a side on the same engine; the contexts grow by
  2 x runs x steps tokens over the measurement. 8K prompts are cut to fit the model's 8192
  positions with that growth and the tokens decoded while the batch prefills.

Policies: fp16; fp8 (E4M3 in groups of 32 with fp16 scales); int4 (KIVI per-channel keys,
Hadamard-rotated values in groups of 64); or any registry dtype at its default layout
(`benchmarks.format_steps.registry_policy`). Below 1 the fused kernel is faster.

--against fp16 times the op against the fused kernel over an fp16 stream of the same vectors
instead of against the torch path (issue 41's second target, one layer's attention only; a
whole step: `benchmarks.format_steps`).

    .venv/bin/python -m benchmarks.fused_decode [--runs 6] [--policies fp16,fp8,int4]
        [--batches 1,4,8] [--contexts 2048,8192] [--calls 20] [--seconds 0.3] [--steps 3]
        [--timed op,step] [--against torch] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console

from benchmarks.decoding import finish_running, random_prompts, start_decoding
from benchmarks.format_steps import registry_policy
from benchmarks.tables import print_rows
from kvtune.kernels.attention.decode_torch import decode_attention_torch
from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.cache.pool import KVPool, write_vectors_ref
from kvtune.kernels.native.build import DISABLE_VARIABLE
from kvtune.kernels.native.decode_attention import SOURCE, decode_attention_native
from kvtune.runtime import LLM
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy

MODEL = "smollm2-135m"
POLICIES = {
    "fp16": KVPolicy("fp16", "fp16"),
    "fp8": KVPolicy("fp8", "fp8"),
    "int4": KVPolicy("int4", "int4", group_size=64, k_scale_axis="channel", rotation="hadamard"),
}
WRITE_CHUNK = 4096  # slots quantized at a time while filling a pool
BATCHED_TOKENS = 2048  # the engine's prefill chunk


def paired_ratios(
    fused: Callable[[], None], torch_path: Callable[[], None], runs: int, repeats: int
) -> tuple[list[float], float]:
    """Per run, seconds of `repeats` fused calls / of `repeats` torch-path calls, the calls of
    the two sides taken in turns (which goes first alternates), after one discarded call of
    each; and the torch path's mean seconds a call."""
    fused()
    torch_path()
    ratios, torch_seconds = [], []
    for _ in range(runs):
        seconds = {"fused": 0.0, "torch": 0.0}
        for repeat in range(repeats):
            for side in ("fused", "torch") if repeat % 2 else ("torch", "fused"):
                started = time.perf_counter()
                (fused if side == "fused" else torch_path)()
                seconds[side] += time.perf_counter() - started
        ratios.append(seconds["fused"] / seconds["torch"])
        torch_seconds.append(seconds["torch"] / repeats)
    return ratios, statistics.mean(torch_seconds)


def calls_for(call: Callable[[], None], seconds: float, most: int) -> int:
    """How many calls of `call` take about `seconds` (one timed call tells), 1 to `most`."""
    started = time.perf_counter()
    call()
    return max(1, min(most, round(seconds / (time.perf_counter() - started))))


def filled_stream(policy: KVPolicy, batch: int, context: int, seed: int) -> PagedStream:
    """One stream of `batch` sequences of `context` random vectors (standard normal) each, in
    pools of the policy's first layer's K and V formats, blocks of each sequence shuffled."""
    arch = arch_from_folder(resolve_model(MODEL))
    formats = layer_formats(arch, policy)[0]
    block_size = policy.block_size
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    generator = torch.Generator().manual_seed(seed)
    pools = []
    for fmt in (formats.k, formats.v):
        scale = torch.tensor([1.0]) if fmt.quantized else None
        pool = KVPool.allocate(fmt, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, scale)
        for start in range(0, num_blocks * block_size, WRITE_CHUNK):
            slots = torch.arange(start, min(start + WRITE_CHUNK, num_blocks * block_size))
            vectors = torch.randn(len(slots), arch.num_kv_heads, arch.head_dim, generator=generator)
            write_vectors_ref(pool, slots, vectors)
        pools.append(pool)
    table = torch.randperm(num_blocks, generator=generator).int().view(batch, blocks_per_seq)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    return PagedStream(pools[0], pools[1], table, lengths, torch.zeros_like(lengths))


def time_op(
    policy: KVPolicy,
    batch: int,
    context: int,
    runs: int,
    calls: int,
    seconds: float,
    against_fp16: bool = False,
) -> tuple[list[float], float]:
    """Ratios of the fused kernel over the policy's stream to the torch path over it, or to
    the fused kernel over an fp16 stream of the same vectors (against_fp16); and the other
    side's mean seconds a call."""
    arch = arch_from_folder(resolve_model(MODEL))
    seed = batch * 100_000 + context
    stream = filled_stream(policy, batch, context, seed)
    q = torch.randn(batch, arch.num_attention_heads, arch.head_dim)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    scale = arch.head_dim**-0.5
    fused_out = decode_attention_native(q, starts, [stream], scale)
    if fused_out is None:
        raise RuntimeError(f"{policy}: the fused kernel does not serve this cache")
    if against_fp16:
        fp16 = filled_stream(POLICIES["fp16"], batch, context, seed)
        other = lambda: decode_attention_native(q, starts, [fp16], scale)  # noqa: E731
    else:
        other = lambda: decode_attention_torch(q, starts, [stream], scale)  # noqa: E731
    return paired_ratios(
        lambda: decode_attention_native(q, starts, [stream], scale),
        other,
        runs,
        calls_for(other, seconds, calls),
    )


def fused_switch(on: bool) -> None:
    """The fused kernel on, or its torch path (every other native kernel stays on)."""
    if on:
        os.environ.pop(DISABLE_VARIABLE, None)
    else:
        os.environ[DISABLE_VARIABLE] = SOURCE.stem


def time_steps(
    llm: LLM, batch: int, context: int, runs: int, steps: int
) -> tuple[list[float], float]:
    # Timed and discarded steps, and those the first sequences decode while the others prefill.
    growth = 2 * runs * steps + 8 + batch * context // BATCHED_TOKENS + 1
    prompt_len = min(context, llm.arch.max_position_embeddings - growth)
    engine = llm.engine
    start_decoding(engine, random_prompts(prompt_len, batch), growth)

    def stepper(on: bool) -> Callable[[], None]:
        def step() -> None:
            fused_switch(on)
            engine.step()

        return step

    try:
        return paired_ratios(stepper(True), stepper(False), runs, steps)
    finally:
        fused_switch(True)
        finish_running(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--calls", type=int, default=20, help="most op calls a side per run")
    parser.add_argument(
        "--seconds", type=float, default=0.3, help="about how long a side's op calls take a run"
    )
    parser.add_argument("--steps", type=int, default=3, help="engine steps a side per run")
    parser.add_argument("--timed", default="op,step", help="op, step or both")
    parser.add_argument(
        "--against", choices=("torch", "fp16"), default="torch", help="the op's other side"
    )
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.against == "fp16" and args.timed != "op":
        parser.error("--against fp16 times the op only: --timed op")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    timed = args.timed.split(",")
    console = Console(stderr=True)
    lines = []
    head_dim = arch_from_folder(resolve_model(MODEL)).head_dim
    for name in args.policies.split(","):
        policy = POLICIES[name] if name in POLICIES else registry_policy(name, head_dim)
        llm = None
        if "step" in timed:
            llm = LLM(
                MODEL,
                policy=policy,
                max_model_len=arch_from_folder(resolve_model(MODEL)).max_position_embeddings,
                max_num_seqs=max(batches),
                max_num_batched_tokens=BATCHED_TOKENS,
            )
        for context in contexts:
            for batch in batches:
                timings = []
                if "op" in timed:
                    op = time_op(
                        policy,
                        batch,
                        context,
                        args.runs,
                        args.calls,
                        args.seconds,
                        args.against == "fp16",
                    )
                    timings.append(("op", op))
                if llm is not None:
                    timings.append(("step", time_steps(llm, batch, context, args.runs, args.steps)))
                for kind, (ratios, torch_seconds) in timings:
                    line = [
                        name,
                        str(batch),
                        str(context),
                        kind,
                        f"{torch_seconds * 1e3:.2f}",
                        " ".join(f"{ratio:.2f}" for ratio in ratios),
                        f"{statistics.mean(ratios):.2f}",
                    ]
                    console.log(" | ".join(line))
                    lines.append(line)
        del llm
    other = "fp16 fused" if args.against == "fp16" else "torch path"
    headers = ["cache", "batch", "context", "timed", f"{other} ms", f"fused / {other}, each run"]
    print_rows([*headers, "mean"], lines, args.markdown, Console())


if __name__ == "__main__":
    main()
