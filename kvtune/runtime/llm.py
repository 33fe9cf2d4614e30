"""`LLM`: load a model, build its paged KV cache under a policy, generate and score prompts.

Everything cheap is checked first (policy, backend, model folder, KV budget), so a bad setting
fails in milliseconds, before weights are read.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.backends import cache_ops
from kvtune.runtime.cache_pools import layer_rotations
from kvtune.runtime.calibration import calibrate_tensor_scales, calibration_token_ids
from kvtune.runtime.dtypes import DTYPE_NAMES, compute_dtype_name
from kvtune.runtime.engine import Engine, EngineConfig, engine_pools
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.model import DecoderModel, resolve_dtype
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class Generation:
    """One request's result: generated token ids, their text, and its metrics."""

    token_ids: list[int]
    text: str
    metrics: dict[str, Any]


def as_policy(policy: KVPolicy | Mapping[str, Any] | None) -> KVPolicy:
    if policy is None:
        return KVPolicy()
    if isinstance(policy, KVPolicy):
        return policy
    if isinstance(policy, Mapping):
        return KVPolicy.from_dict(policy)
    raise ConfigError("policy", type(policy).__name__, "a KVPolicy, a dict of its fields, or None")


class LLM:
    """A model served by the kvtune runtime under one KV policy.

    model: an embedded model ("smollm2-135m", "qwen2.5-coder-0.5b") or a local Hugging Face
        folder (Llama, Mistral, Qwen2).
    backend: "torch" (reference ops, the CPU default) or "triton" (the kernels).
    kv_budget_bytes: bytes for all KV pools; None sizes them for max_num_seqs sequences of
        max_model_len tokens, or, with gpu_memory_utilization on CUDA, from the device:
        total memory x utilization - what the loaded weights occupy - activation_reserve_bytes.
    dtype: compute dtype, spelt as in vLLM or PyTorch (fp32 | float32 | float, fp16 | float16
        | half, bf16 | bfloat16, a torch.dtype, or auto: the checkpoint's own); `auto` K/V
        streams are stored in it.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        policy: KVPolicy | Mapping[str, Any] | None = None,
        backend: str = "torch",
        device: str = "cpu",
        kv_budget_bytes: int | None = None,
        max_num_seqs: int = 8,
        dtype: str | torch.dtype = "fp32",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        scheduling: str = "fcfs",
        seed: int = 0,
        gpu_memory_utilization: float | None = None,
        activation_reserve_bytes: int = 1 << 30,
    ) -> None:
        self.policy = as_policy(policy)
        ops = cache_ops(backend)
        compute_dtype_name(dtype)  # a misspelt dtype fails before the model is looked up
        folder = resolve_model(model)
        checkpoint = arch_from_folder(folder)
        torch_dtype = resolve_dtype(compute_dtype_name(dtype, checkpoint.dtype))
        self.arch = dataclasses.replace(checkpoint, dtype=DTYPE_NAMES[torch_dtype])
        self.policy.check_model(self.arch)
        length = max_model_len or self.arch.max_position_embeddings
        self.arch.check_context(length, "max_model_len")
        config = EngineConfig(
            max_model_len=length,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_budget_bytes=kv_budget_bytes,
            scheduling=scheduling,
            seed=seed,
        )
        self.device = torch.device(device)
        if gpu_memory_utilization is not None and self.device.type != "cuda":
            raise ConfigError("gpu_memory_utilization", gpu_memory_utilization, "CUDA devices only")
        if gpu_memory_utilization is None:
            engine_pools(self.arch, self.policy, config, self.device)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.model = DecoderModel.from_checkpoint(folder, torch_dtype, device)
        if gpu_memory_utilization is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            used = torch.cuda.memory_allocated(self.device)
            budget = int(total * gpu_memory_utilization) - used - activation_reserve_bytes
            config = dataclasses.replace(config, kv_budget_bytes=budget)
        self._ops, self._config = ops, config
        self.engine = self._build_engine()

    def _build_engine(self) -> Engine:
        """Calibrated tensor scales, pools and scheduler for self.policy over the loaded model."""
        scales = calibrate_tensor_scales(
            self.model,
            calibration_token_ids(self.tokenizer),
            layer_formats(self.arch, self.policy),
            layer_rotations(self.arch, self.policy, self.device),
        )
        return Engine(
            self.model, self.arch, self.policy, self._ops, self._config, scales, self.device
        )

    def with_policy(self, policy: KVPolicy | Mapping[str, Any]) -> LLM:
        """The same loaded weights under another KV policy: a new cache and engine, no reload
        (what a search over many policies needs). Engine settings stay as they were."""
        other = copy.copy(self)
        other.policy = as_policy(policy)
        other.policy.check_model(self.arch)
        other.engine = other._build_engine()
        return other

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
        return self.tokenizer.encode(prompt)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        chat: bool = False,
    ) -> list[Generation]:
        """Generate for every prompt (text, or token ids) with continuous batching.

        chat: wrap text prompts as one user message in the model's chat template.
        """
        stop = frozenset(self.tokenizer.eos_token_ids)
        seqs = [
            self.engine.add_request(self.encode_prompt(p, chat), max_new_tokens, temperature, stop)
            for p in prompts
        ]
        self.engine.run()
        return [
            Generation(list(s.output_ids), self.tokenizer.decode(s.output_ids), s.metrics.to_dict())
            for s in seqs
        ]

    @torch.no_grad()
    def prompt_logits_batch(
        self, prompts: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """fp32 logits [len - start, vocab] at each prompt's positions from its start (default
        0: every position), computed by chunked prefill through the policy's cache (what
        evaluation scores). Positions before a start skip the vocabulary projection."""
        starts = [0] * len(prompts) if starts is None else starts
        if len(starts) != len(prompts):
            raise ConfigError("starts", len(starts), f"one start per prompt ({len(prompts)})")
        seqs = [
            self.engine.add_request(list(ids), 0, prompt_logits_from=start)
            for ids, start in zip(prompts, starts, strict=True)
        ]
        self.engine.run()
        return [self.engine.take_prompt_logits(seq) for seq in seqs]

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.prompt_logits_batch([token_ids])[0]

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()
