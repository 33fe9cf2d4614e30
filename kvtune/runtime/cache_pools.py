"""Each layer's pool tensors: K and V pools by block kind, allocated once for the engine's
plan (kvtune/runtime/pool_plan.py), in the basis the layer caches them in.

Per layer: a main pool in the layer's K and V formats (quantized tokens and CSA summaries) and,
when recent_unquantized > 0 or keys are scaled per channel, an fp16 pool for the most recent
tokens (for per-channel keys at least the partial last block, quantized once full). With
selection, the layers that select also hold an index pool and a host tier (in host memory), and
a streamed staging pool is one tensor per distinct layer format that the layers of that format
share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtune.kernels.cache.pool import KVPool
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.rotation import KVRotation, kv_rotation
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.kv_bytes import layer_formats
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, RECENT, STAGE


@dataclass(frozen=True)
class LayerPools:
    """K and V pools of one layer, by block kind (MAIN, and RECENT, HOST, INDEX, STAGE when
    used; a STAGE pool views codes shared by the layers of one format)."""

    k: dict[str, KVPool]
    v: dict[str, KVPool]


def layer_rotations(
    arch: ModelArch, policy: KVPolicy, device: torch.device | str
) -> list[KVRotation]:
    """Per layer, the rotations its K and V are cached in (policy.rotation), all their pools
    alike: none in a layer that quantizes neither stream (`kv_rotation`)."""
    return [
        kv_rotation(
            policy.rotation,
            arch.cached_vector_size,
            layer,
            (formats.k.quantized, formats.v.quantized),
            device,
        )
        for layer, formats in enumerate(layer_formats(arch, policy))
    ]


def allocate_layer_pools(
    arch: ModelArch,
    policy: KVPolicy,
    counts: dict[str, int],
    tensor_scales: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> list[LayerPools]:
    """Every layer's pools of counts[kind] blocks each, zero-filled, with the layer's tensor
    scales (K, V)."""
    layers = []
    bs, heads, size = policy.block_size, arch.cached_heads, arch.cached_vector_size
    layer_topk = policy.layer_topk(arch.num_layers)
    shared_stages: dict[tuple[KVFormat, KVFormat], tuple[KVPool, KVPool]] = {}
    for formats, (k_scale, v_scale), topk in zip(
        layer_formats(arch, policy), tensor_scales, layer_topk, strict=True
    ):
        k_pools = {MAIN: KVPool.allocate(formats.k, counts[MAIN], bs, heads, size, k_scale, device)}
        v_pools = {MAIN: KVPool.allocate(formats.v, counts[MAIN], bs, heads, size, v_scale, device)}
        if counts[RECENT]:
            k_pools[RECENT] = KVPool.allocate(
                formats.k_recent, counts[RECENT], bs, heads, size, None, device
            )
            v_pools[RECENT] = KVPool.allocate(
                formats.v_recent, counts[RECENT], bs, heads, size, None, device
            )
        # A layer whose budget is 0 never reads an older block exactly: no index, no copies.
        if counts[INDEX] and topk:
            for pools, fmt, scale in (
                (k_pools, formats.k_index, k_scale),
                (v_pools, formats.v_index, v_scale),
            ):
                if fmt is None:  # a means index: no V half
                    continue
                scale = None if policy.separate_index else scale
                pools[INDEX] = KVPool.allocate(fmt, counts[INDEX], bs, heads, size, scale, device)
        if counts[HOST] and topk:
            for pools, fmt, scale in (
                (k_pools, formats.k, k_scale),
                (v_pools, formats.v, v_scale),
            ):
                pools[HOST] = _host_pool(fmt, counts[HOST], bs, heads, size, scale, device)
        if counts[STAGE]:
            shared = shared_stages.setdefault(
                (formats.k, formats.v),
                tuple(
                    KVPool.allocate(fmt, counts[STAGE], bs, heads, size, None, device)
                    for fmt in (formats.k, formats.v)
                ),
            )
            # The layer's own tensor scale over the shared codes.
            k_pools[STAGE], v_pools[STAGE] = (
                KVPool(pool.codes, pool.scales, pool.fmt, scale)
                for pool, scale in zip(shared, (k_scale, v_scale), strict=True)
            )
        layers.append(LayerPools(k_pools, v_pools))
    return layers


def pool_tensor_bytes(layers: list[LayerPools], counted: Callable[[str], bool]) -> int:
    """Bytes of the pool tensors of the kinds counted, each shared tensor once."""
    tensors: dict[int, torch.Tensor] = {}
    for layer in layers:
        for by_kind in (layer.k, layer.v):
            for kind, pool in by_kind.items():
                if counted(kind):
                    for tensor in (pool.codes, pool.scales):
                        if tensor is not None:
                            tensors[tensor.data_ptr()] = tensor
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _host_pool(
    fmt: KVFormat,
    num_blocks: int,
    block_size: int,
    heads: int,
    size: int,
    tensor_scale: torch.Tensor | None,
    device: torch.device,
) -> KVPool:
    """A host-tier pool in the layer's format: pinned host memory beside a CUDA device, the
    same memory on a CPU."""
    scale = None if tensor_scale is None else tensor_scale.cpu()
    pool = KVPool.allocate(fmt, num_blocks, block_size, heads, size, scale, "cpu")
    if device.type != "cuda":
        return pool
    scales = None if pool.scales is None else pool.scales.pin_memory()
    return KVPool(pool.codes.pin_memory(), scales, fmt, scale)
