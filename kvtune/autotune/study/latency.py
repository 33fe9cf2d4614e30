"""Latency of a policy measured on the kvtune runtime, at a workload's shape.

Two measurements on one engine: `batch` sequences of `context_len` tokens decoding together
(time to first token and time per output token, the prefill/decode split DESIGN.md section 4
asks for), then a short seeded trace replayed with Poisson arrivals, whose end-to-end latencies
give the P99 a user would see under load. Prompts are real text (token ids of a fixed
passage); requests never stop early, so every trial times the same token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtune.autotune.config.workload import TraceRequest, Workload
from kvtune.runtime.llm import LLM
from kvtune.runtime.sequence import Sequence

FILLER_TEXT = (
    "Ships arrive at the harbour at dawn and leave at dusk. The harbour master records each "
    "arrival, the cargo, the crew and the weather. In winter the storms close the port for "
    "days; in summer the quays are crowded with fishing boats, ferries and yachts. "
)


@dataclass(frozen=True)
class LatencyResult:
    """Measured latencies (ms) on the runtime, labelled by what was timed."""

    ttft_ms: float
    tpot_ms: float
    p50_latency_ms: float
    p99_latency_ms: float
    preemptions: int


def prompt_ids(llm: LLM, length: int, offset: int) -> list[int]:
    """`length` token ids of the filler passage, starting `offset` tokens in (varies requests)."""
    base = llm.tokenizer.encode(FILLER_TEXT)
    repeats = (length + offset) // len(base) + 1
    return (base * repeats)[offset : offset + length]


def measure_batch(llm: LLM, workload: Workload) -> tuple[float, float]:
    """Mean TTFT and TPOT (ms) of `batch` sequences of context_len tokens decoding together."""
    prompt_len = workload.context_len - workload.decode_tokens
    seqs = [
        llm.engine.add_request(prompt_ids(llm, prompt_len, 7 * i), workload.decode_tokens)
        for i in range(workload.batch)
    ]
    llm.engine.run()
    ttft = [s.metrics.ttft for s in seqs]
    tpot = [s.metrics.tpot for s in seqs]
    return 1e3 * float(np.mean(ttft)), 1e3 * float(np.mean(tpot))


def replay_trace(llm: LLM, trace: list[TraceRequest]) -> list[float]:
    """End-to-end latency (s) of each trace request, from its scheduled arrival to its last
    token. Requests join the running engine when the clock passes their arrival; while the
    engine is idle the clock skips ahead to the next arrival instead of sleeping."""
    engine = llm.engine
    start = engine.now()
    pending = sorted(trace, key=lambda r: r.arrival_s)
    started: list[tuple[float, Sequence]] = []
    while pending or engine.scheduler.has_work:
        elapsed = engine.now() - start
        if not engine.scheduler.has_work and pending[0].arrival_s > elapsed:
            start -= pending[0].arrival_s - elapsed  # nothing in flight: no latency is distorted
            elapsed = pending[0].arrival_s
        while pending and pending[0].arrival_s <= elapsed:
            request = pending.pop(0)
            ids = prompt_ids(llm, request.prompt_tokens, 11 * len(started))
            seq = engine.add_request(ids, request.output_tokens)
            started.append((start + request.arrival_s, seq))
        engine.step()
    return [seq.metrics.finished - arrival for arrival, seq in started]


def measure_latency(llm: LLM, workload: Workload) -> LatencyResult:
    ttft_ms, tpot_ms = measure_batch(llm, workload)
    latencies = replay_trace(llm, workload.trace())
    return LatencyResult(
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        p50_latency_ms=1e3 * float(np.percentile(latencies, 50)),
        p99_latency_ms=1e3 * float(np.percentile(latencies, 99)),
        preemptions=int(llm.stats()["preemptions"]),
    )
