"""The engine loop: schedule a batch, run the model over the paged cache, sample, repeat.

One step serves decodes and prefill chunks together (continuous batching). The engine sizes
the pools from a byte budget with the planner's sizing (kvtune/runtime/pool_plan.py), refuses
settings that cannot hold one full-length sequence before allocating anything, and keeps
per-request and engine-wide metrics.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtune.runtime.arch import ModelArch
from kvtune.runtime.backends import CacheOps
from kvtune.runtime.block_manager import BlockManager, SequenceKV
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.host_memory import keep_freed_host_memory
from kvtune.runtime.kv_cache import KVCache
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import DEVICE_KINDS, HOST, INDEX, MAIN, RECENT, STAGE
from kvtune.runtime.pool_plan import PoolLimits, PoolPlan, plan_pools
from kvtune.runtime.scheduler import ScheduledSequence, Scheduler
from kvtune.runtime.sequence import RequestMetrics, Sequence

logger = logging.getLogger(__name__)

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderModel(Protocol):
    """What the engine needs of a model: packed forward with pluggable attention, logits, and
    its RoPE speeds (inv_freq, to pool summaries as if before RoPE)."""

    inv_freq: torch.Tensor

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. kv_budget_bytes: device bytes for all KV pools (None: room for
    max_num_seqs sequences of max_model_len)."""

    max_model_len: int
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    kv_budget_bytes: int | None = None
    scheduling: str = "fcfs"
    seed: int = 0


def engine_pools(
    arch: ModelArch, policy: KVPolicy, config: EngineConfig, device: torch.device
) -> PoolPlan:
    """The pools for config on device (kvtune/runtime/pool_plan.py); refuses a budget below one
    full-length sequence. Arithmetic only, so callers run it before loading any weights. The
    host tier lives in host memory, off any device but the CPU."""
    limits = PoolLimits(
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        step_tokens=config.max_num_batched_tokens or policy.chunk_size,
        host_tier_remote=device.type != "cpu",
    )
    return plan_pools(arch, policy, limits, config.kv_budget_bytes)


class Engine:
    """Continuous-batching engine over a paged, quantized, compressed KV cache."""

    def __init__(
        self,
        model: DecoderModel,
        arch: ModelArch,
        policy: KVPolicy,
        ops: CacheOps,
        config: EngineConfig,
        tensor_scales: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
    ) -> None:
        self.model = model
        self.arch = arch
        self.policy = policy
        self.config = config
        self.device = device
        self.pools = engine_pools(arch, policy, config, device)
        keep_freed_host_memory()  # the host tier and the torch path's temporaries live there
        counts = self.pools.blocks
        self.blocks = BlockManager(
            policy, counts[MAIN], counts[RECENT], counts[HOST], counts[INDEX], counts[STAGE]
        )
        self.cache = KVCache(arch, policy, self.blocks, ops, tensor_scales, device, model.inv_freq)
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, self.pools.limits.step_tokens, config.scheduling
        )
        self.scale = 1.0 / math.sqrt(arch.head_dim)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._ids = itertools.count()
        self._clock_start = time.perf_counter()
        # seq_id -> (first kept prompt position, {chunk start position: logits})
        self._prompt_logits: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}
        logger.info(
            "KV pools: %d main blocks, %d recent blocks, %.1f MiB",
            counts[MAIN],
            counts[RECENT],
            self.cache.allocated_bytes / 2**20,
        )

    def now(self) -> float:
        return time.perf_counter() - self._clock_start

    def add_request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids: frozenset[int] = frozenset(),
        prompt_logits_from: int | None = None,
    ) -> Sequence:
        """Queue a request; prompts longer than max_model_len are refused before any work.

        prompt_logits_from: keep the logits of prompt positions from this one on (for
        take_prompt_logits); the vocabulary projection runs only there.
        """
        if not prompt_ids:
            raise ConfigError("prompt", "<empty>", "at least one token")
        if len(prompt_ids) > self.config.max_model_len:
            raise ConfigError(
                "prompt",
                f"<{len(prompt_ids)} tokens>",
                f"at most max_model_len={self.config.max_model_len} tokens",
            )
        if max_new_tokens < 0 or temperature < 0:
            raise ConfigError("max_new_tokens/temperature", (max_new_tokens, temperature), ">= 0")
        metrics = RequestMetrics(arrival=self.now(), prompt_tokens=len(prompt_ids))
        seq = Sequence(
            next(self._ids), list(prompt_ids), max_new_tokens, temperature, metrics, stop_ids
        )
        if prompt_logits_from is not None:
            if not 0 <= prompt_logits_from < len(prompt_ids):
                raise ConfigError(
                    "prompt_logits_from", prompt_logits_from, f"0..{len(prompt_ids) - 1}"
                )
            self._prompt_logits[seq.seq_id] = (prompt_logits_from, {})
        self.scheduler.add(seq)
        return seq

    def _held_bytes(self, kv: SequenceKV) -> int:
        held = self.blocks.held(kv)
        return sum(held[kind] * self.pools.block_bytes[kind] for kind in DEVICE_KINDS)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that finished in it. In inference mode: no
        autograd bookkeeping on any op (a selecting decode step runs thousands of small ones)."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("scheduler produced an empty batch while requests are queued")
        now = self.now()
        for item in batch:
            if item.seq.metrics.first_scheduled is None:
                item.seq.metrics.first_scheduled = now
        hidden = self._forward(batch)
        rows = self._advance(batch)
        return self._sample(batch, hidden, rows)

    def _forward(self, batch: list[ScheduledSequence]) -> torch.Tensor:
        """Run the model over this step's tokens. The cache is first brought to what each
        sequence's last new position sees in decode (demotions and compressions up to there), so
        a prefill position reads the cache a decode step at that position would read; the
        blocks this retires stay readable until the step's attention is done."""
        ids, positions = [], []
        kvs = [self.scheduler.kv[item.seq.seq_id] for item in batch]
        copies = []
        for item, kv in zip(batch, kvs, strict=True):
            seq = item.seq
            span = range(seq.num_cached, seq.num_cached + item.num_tokens)
            ids.extend(seq.token_ids[span.start : span.stop])
            positions.append(list(span))
            copies.extend(self.blocks.maintain(kv, upto=span.stop - 1))
        layout = self.cache.layout(kvs, [item.slots for item in batch], positions, copies)

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            return self.cache.attend(layer, layout, q, k, v, self.scale)

        flat_positions = torch.tensor([p for seq in positions for p in seq], device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, flat_positions, attention)
        self.blocks.release(copies, kvs)
        return hidden

    def _advance(self, batch: list[ScheduledSequence]) -> list[range]:
        """Mark this step's tokens cached, compress/move blocks; returns each item's rows."""
        copies = []
        rows, start = [], 0
        kvs = [self.scheduler.kv[item.seq.seq_id] for item in batch]
        for item, kv in zip(batch, kvs, strict=True):
            item.seq.num_cached += item.num_tokens
            copies.extend(self.blocks.maintain(kv))
            rows.append(range(start, start + item.num_tokens))
            start += item.num_tokens
        self.cache.apply_copies(copies, kvs)
        self.blocks.release(copies, kvs)
        return rows

    def _sample(
        self, batch: list[ScheduledSequence], hidden: torch.Tensor, rows: list[range]
    ) -> list[Sequence]:
        finished = []
        now = self.now()
        # Every sampled row projected at once: the output matrix (the largest weight of a small
        # model) is then read once a step, not once a sequence.
        last_rows = [r.stop - 1 for item, r in zip(batch, rows, strict=True) if _samples(item.seq)]
        next_logits = iter(self.model.logits(hidden[last_rows]) if last_rows else ())
        for item, item_rows in zip(batch, rows, strict=True):
            seq = item.seq
            kv = self.scheduler.kv[seq.seq_id]
            seq.metrics.peak_kv_bytes = max(seq.metrics.peak_kv_bytes, self._held_bytes(kv))
            if seq.seq_id in self._prompt_logits:
                self._keep_prompt_logits(seq, hidden, item_rows)
            if seq.num_cached < seq.num_tokens:
                continue  # more prefill chunks to come
            if _samples(seq):
                seq.append_token(self._choose(next(next_logits), seq.temperature))
                if seq.metrics.first_token is None:
                    seq.metrics.first_token = now
            if not seq.output_ids or seq.should_stop(self.config.max_model_len):
                seq.metrics.finished = now
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def _keep_prompt_logits(self, seq: Sequence, hidden: torch.Tensor, rows: range) -> None:
        """Project this chunk's wanted prompt positions to logits, keyed by position (a
        recomputed chunk after preemption overwrites its first pass)."""
        first_kept, chunks = self._prompt_logits[seq.seq_id]
        start = seq.num_cached - len(rows)
        skip = max(0, first_kept - start)
        end = min(len(rows), len(seq.prompt_ids) - start)
        if skip < end:
            wanted = hidden[rows.start + skip : rows.start + end]
            chunks[start + skip] = self.model.logits(wanted).float().cpu()

    def _choose(self, logits: torch.Tensor, temperature: float) -> int:
        if temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def run(self) -> None:
        while self.scheduler.has_work:
            self.step()

    def take_prompt_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits [prompt_len - first kept position, vocab] (fp32, CPU) of a finished
        request's kept prompt positions."""
        first_kept, chunks = self._prompt_logits.pop(seq.seq_id)
        vocab = next(iter(chunks.values())).shape[-1]
        out = torch.empty(len(seq.prompt_ids) - first_kept, vocab)
        for start, logits in sorted(chunks.items()):
            out[start - first_kept : start - first_kept + len(logits)] = logits
        return out

    def stats(self) -> dict[str, float | int]:
        """Engine-wide KV usage: pool bytes, bytes held by sequences, fragmentation, peaks."""
        held = filled = 0
        for seq in self.scheduler.running:
            kv = self.scheduler.kv[seq.seq_id]
            held += self._held_bytes(kv)
            filled += self._filled_bytes(kv)
        stats: dict[str, float | int] = {
            "kv_allocated_bytes": self.cache.allocated_bytes,
            "kv_in_use_bytes": held,
            "kv_fragmentation": (held - filled) / held if held else 0.0,
            "peak_main_blocks": self.blocks.pools[MAIN].peak_used,
            "peak_recent_blocks": self.blocks.pools[RECENT].peak_used,
            "kv_host_allocated_bytes": self.cache.host_allocated_bytes,
            "kv_fetched_bytes": self.cache.fetched_bytes,
            "kv_rescored_bytes": self.cache.rescored_bytes,
            # K/V values beyond their stream's range (saturated), of those checked
            # (kvtune/runtime/clip_counter.py: per-tensor and E4M3-group-scaled streams).
            "kv_clipped_values": self.cache.clips.clipped,
            "kv_range_checked_values": self.cache.clips.checked,
            "preemptions": self.scheduler.num_preemptions,
        }
        if self.device.type == "cuda":
            stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return stats

    def _filled_bytes(self, kv: SequenceKV) -> int:
        """Bytes of the slots that hold a vector (blocks minus their unused tail slots)."""
        bs = self.policy.block_size
        per_slot = {kind: size // bs for kind, size in self.pools.block_bytes.items()}
        filled = kv.num_summaries * per_slot[MAIN]
        for stream in (kv.sinks, kv.window):
            for index, block in enumerate(stream.blocks):
                slots = min(bs, stream.length - index * bs)
                filled += slots * per_slot[block.kind]
        return filled


def _samples(seq: Sequence) -> bool:
    """Whether this step samples a token for seq: its prompt is cached and it may grow."""
    return seq.num_cached >= seq.num_tokens and seq.max_new_tokens > len(seq.output_ids)
