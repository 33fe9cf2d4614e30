"""CSA selection (policy.selects) in one layer's attention: each query's older blocks chosen
on the index, their exact form shown and their summaries hidden.

Each older block keeps its exact copy in a host tier, and in every layer each query reads
exactly the csa_topk blocks it selects by their key bounds, mean keys or summaries
(kernels/selection/blocks.py), the summaries of the others (none without summaries). Bounds and
means live in a per-layer index pool (means in its K half only): in the layer's formats and
rotated space, or (a separate csa_index_dtype) in the model's basis, scored with the unrotated
queries. A prefill chunk reads the selected blocks where they are (each query its own choice,
by mask); a decode step fetches them into the sequence's staging blocks (host_fetch.py). With
csa_rescore > 1 the index shortlists and the host tier's exact keys decide
(kernels/selection/rescore.py). With csa_select_every > 1 a query is scored by its anchor's
query (`select_anchors`), and a decode step whose choice would not change reuses the staged
one.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtune.kernels.attention.paged import PagedStream
from kvtune.kernels.selection.blocks import IndexProducts, select_blocks
from kvtune.kernels.selection.rescore import rescore_decode, rescore_prefill
from kvtune.runtime.block_manager import SequenceKV
from kvtune.runtime.cache_pools import LayerPools
from kvtune.runtime.host_fetch import HostFetch
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, MAIN
from kvtune.runtime.step_layout import StepLayout, block_table, int32_tensor


class BlockSelection:
    """Selection for every layer: layer_topk and layer_every are each layer's budget and
    csa_select_every; `fetch` moves the chosen blocks; key_bytes: one block's keys in each
    layer (what rescoring reads of it)."""

    def __init__(
        self,
        policy: KVPolicy,
        layers: list[LayerPools],
        fetch: HostFetch,
        layer_topk: list[int],
        layer_every: list[int],
        key_bytes: list[int],
        device: torch.device,
    ) -> None:
        self.policy = policy
        self.layers = layers
        self.fetch = fetch
        self.layer_topk = layer_topk
        self.layer_every = layer_every
        self.key_bytes = key_bytes
        self.device = device
        # Host-tier key bytes decode steps read to rescore their shortlists (csa_rescore > 1).
        self.rescored_bytes = 0

    def select(
        self,
        layer: int,
        layout: StepLayout,
        q: torch.Tensor,
        exact_q: torch.Tensor,
        positions: torch.Tensor | None,
        scale: float,
        streams: dict[str, PagedStream],
        index: PagedStream,
        index_products: IndexProducts,
    ) -> None:
        """Each query's older blocks (the layer's budget), scored on `index` (key bounds, means
        or summaries, by the backend's index_products) with q in the index's basis (each
        query's anchor query, `select_anchors`; exact_q the same queries in the cache's space,
        for csa_rescore): their summaries (if any) hidden from it,
        their exact form shown (in place in the host tier for a prefill step, fetched for a
        decode step). A layer whose budget is 0 reads what a compressed layer without
        selection reads."""
        policy = self.policy
        bs = policy.block_size
        per_block = bs // policy.csa_ratio
        summary_key, host_key = "summary" + MAIN, "host" + HOST
        topk = self.layer_topk[layer]
        if topk == 0:  # the layer holds no host tier
            return
        plan = layout.anchors.get(self.layer_every[layer])
        reuses = positions is None and plan is not None and not plan.reselects
        if reuses:
            chosen = self._last_choices(layer, layout.kvs)
        else:
            chosen = select_blocks(
                q,
                positions,
                layout.q_seq_starts,
                index,
                per_block if policy.csa_index == "summaries" else 1,
                topk * policy.csa_rescore,
                scale,
                policy.csa_index,
                index_products,
            )
        host = streams.pop(host_key)
        if positions is not None and self.fetch.host_is_remote(host):
            host = self.fetch.fetch_for_prefill(layer, host)
        if policy.csa_rescore > 1 and not reuses:
            chosen = self._rescored(layer, exact_q, positions, layout, host, chosen, topk)
        if policy.summarises:
            streams[summary_key] = dataclasses.replace(
                streams[summary_key], query_mask=~chosen.repeat_interleave(per_block, dim=2)
            )
        if positions is not None:
            streams[host_key] = dataclasses.replace(
                host, query_mask=chosen.repeat_interleave(bs, dim=2)
            )
            return
        if reuses:
            staged = self.fetch.restage(layer, layout.kvs)
        else:
            rows = chosen.tolist()
            if plan is not None:
                for kv, row in zip(layout.kvs, rows, strict=True):
                    kv.choices[layer] = row
            staged = self.fetch.fetch(layer, layout.kvs, rows)
        pools, kind = self.layers[layer], self.fetch.staging_kind
        streams["staging" + MAIN] = PagedStream(
            pools.k[kind],
            pools.v[kind],
            block_table(staged, self.device),
            int32_tensor([len(ids) * bs for ids in staged], self.device),
            host.start_positions,
        )

    def _rescored(
        self,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor | None,
        layout: StepLayout,
        host: PagedStream,
        shortlist: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        """The budget of each query's shortlist that the host tier's exact keys rank first."""
        if positions is not None:
            return rescore_prefill(q, positions, layout.q_seq_starts, host, shortlist, topk)
        picks, blocks_read = rescore_decode(q, host, shortlist, topk)
        self.rescored_bytes += blocks_read * self.key_bytes[layer]
        return picks

    def _last_choices(self, layer: int, kvs: list[SequenceKV]) -> torch.Tensor | None:
        """bool [S, Hkv, blocks]: the choices of the sequences' last decode selection in
        `layer`, for the summaries they hide (None without summaries: only staging reads
        them). Each row is as wide as its batch's longest then, and no sequence has gained an
        older block since, so the widest row covers every sequence now."""
        if not self.policy.summarises:
            return None
        rows = [kv.choices[layer] for kv in kvs]
        width = max(len(heads[0]) for heads in rows)
        padded = [[head + [False] * (width - len(head)) for head in heads] for heads in rows]
        return torch.tensor(padded, dtype=torch.bool, device=self.device)
