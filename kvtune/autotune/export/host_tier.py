"""The engines' nearest deployable settings for a policy with a host tier (query-aware selection
of older blocks from host memory), and what they cost and lose.

Read from the engines' sources. vLLM (vllm/config/cache.py and vllm/config/vllm.py at
002f10e0): `kv_offloading_size`, a float in GiB (2^30 bytes, summed over tensor-parallel ranks),
turns offloading on with `kv_offloading_backend` `native` (the OffloadingConnector: computed
blocks stored in CPU memory under their prefix hash and loaded back for a later request whose
prompt starts with them) or `lmcache`. SGLang (python/sglang/srt/server_args.py at 001067ff):
`--enable-hierarchical-cache` with `--hicache-size`, whole GB of 10^9 bytes, which overrides
`--hicache-ratio` (the host pool's size over the device pool's): the radix cache's evicted
prefixes kept in host memory and loaded back on a hit.

Both are prefix reuse, not per-step selection: a running request keeps every token on the
device, so neither adds concurrency at a context (the engine rows of the capacity tables stand);
they spare the prefill of a prompt whose prefix an earlier request left in host memory. SGLang's
`--enable-hisparse` (`--hisparse-config` with top_k, device_buffer_size, host_to_device_ratio)
fetches the top-k tokens of each step from a host pool, which is what this policy does, but it
is built on DeepSeek's sparse-attention indexer (its NSA pool and the model's index_topk) and
serves no other model. Double sparsity (`--enable-double-sparsity`, `--ds-*`) is no longer among
SGLang's server arguments at that commit. llama.cpp (common/arg.cpp) has only
`--no-kv-offload`: the whole cache in host memory.
"""

from __future__ import annotations

import math
from typing import Any

from kvtune.autotune.config.settings import ServeSettings
from kvtune.runtime.arch import GIB, ModelArch
from kvtune.runtime.kv_bytes import host_kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy

VLLM_OFFLOAD_UNIT = GIB  # kv_offloading_size * (1 << 30) bytes
VLLM_OFFLOAD_STEP = 0.01  # GiB: the size is rounded up to this
SGLANG_HICACHE_UNIT = 10**9  # hicache_size * 1e9 bytes, an integer count


def host_tier_bytes(arch: ModelArch, policy: KVPolicy, serve: ServeSettings, seqs: int) -> int:
    """Host memory the policy's host tier takes for seqs sequences of the typical context: what
    the engines' host pools are sized to (0 without a host tier)."""
    return seqs * host_kv_bytes_per_sequence(arch, policy, serve.typical_context_len)


def vllm_offloading(host_bytes: int) -> dict[str, Any]:
    """`vllm serve --config` keys giving vLLM's native offloading host_bytes (rounded up; none
    for 0)."""
    if host_bytes <= 0:
        return {}
    gib = math.ceil(host_bytes / VLLM_OFFLOAD_UNIT / VLLM_OFFLOAD_STEP) * VLLM_OFFLOAD_STEP
    return {"kv-offloading-size": round(gib, 2), "kv-offloading-backend": "native"}


def sglang_hicache(host_bytes: int) -> list[str]:
    """SGLang options giving its hierarchical cache host_bytes (whole GB, rounded up; none for
    0)."""
    if host_bytes <= 0:
        return []
    return [
        "--enable-hierarchical-cache",
        f"--hicache-size {math.ceil(host_bytes / SGLANG_HICACHE_UNIT)}",
    ]


def host_tier_notes(policy: KVPolicy, host_bytes: dict[str, int], context: int) -> list[str]:
    """NOTES.md lines: per engine (name -> host bytes its config asks for), the nearest setting,
    what it costs and what it loses against the policy's selection."""
    if not policy.csa_host:
        return []
    if not any(host_bytes.values()):
        return [
            f"At the workload's context ({context} tokens) this policy's host tier holds nothing "
            "(every token is in its sinks and window), so the engine files ask for no host "
            "memory; at longer contexts vLLM's KV offloading and SGLang's hierarchical cache "
            "are the nearest settings, both prefix reuse rather than selection."
        ]
    vllm = vllm_offloading(host_bytes["vLLM"])
    sglang = sglang_hicache(host_bytes["SGLang"])
    return [
        f"This policy keeps the older blocks of a {context}-token context in host memory and "
        f"reads {policy.csa_topk} of them a query (the gaps above). The exported engine files "
        "give each engine the host memory the policy's host tier takes for the sequences that "
        "engine runs, in the engine's nearest setting:",
        f"- vLLM: kv-offloading-size {vllm['kv-offloading-size']} (GiB), kv-offloading-backend "
        "native. Costs that much CPU memory; stores computed blocks there by prefix hash and "
        "loads them back for a later request with the same prefix (multi-turn chat, shared "
        "documents). Loses: a running request keeps every token on the device, so no "
        "concurrency is gained (capacity table); `lmcache` is the other backend.",
        f"- SGLang: {' '.join(sglang)} (GB of 10^9 bytes; overrides --hicache-ratio). The radix "
        "cache's evicted prefixes kept in host memory and loaded back on a hit: the same prefix "
        "reuse, the same loss. `--enable-hisparse` selects top-k tokens a step from a host pool "
        "as this policy does, but only for DeepSeek sparse-attention models (it reads their "
        "indexer); double sparsity is no longer an SGLang server argument.",
        "- llama.cpp: `--no-kv-offload` (-nkvo) keeps the whole cache in host memory and runs "
        "attention there, reading every token a step: the opposite trade (no device bytes, "
        "host bandwidth for all of them); nothing selects, so llama-server.args leaves it out.",
    ]
