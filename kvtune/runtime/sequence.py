"""A request as the engine sees it: its tokens, progress through the cache, and its metrics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request timings (seconds since the engine's clock start) and sizes.

    The field's advice is to watch these per request, not only as totals: a P99 hides in them.
    """

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    peak_kv_bytes: int = 0
    preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token (s)."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (s); None with fewer than two tokens."""
        if self.finished is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_time_s": self.queue_time,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_latency_s": self.e2e_latency,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "peak_kv_bytes": self.peak_kv_bytes,
            "preemptions": self.preemptions,
        }


@dataclass(eq=False)
class Sequence:
    """One request: prompt, generated tokens and how many of them the KV cache holds.

    num_cached counts tokens whose K/V are in the cache; the tokens after it are fed to the
    model next (a prefill chunk, or the last sampled token when decoding).
    """

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    metrics: RequestMetrics
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached: int = 0
    waited_steps: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def is_prefill(self) -> bool:
        """True while several tokens await the cache (a prompt, or a recompute after preemption)."""
        return self.num_uncached > 1

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.metrics.output_tokens = len(self.output_ids)

    def should_stop(self, max_model_len: int) -> bool:
        if not self.output_ids:
            return False
        return (
            len(self.output_ids) >= self.max_new_tokens
            or self.output_ids[-1] in self.stop_ids
            or self.num_tokens >= max_model_len
        )
