"""Per-layer attention profile: where a model's attention goes when an answer is due.

Selection budgets, their reuse and the key format differ by model and by context length, so
kvtune measures them on the model at the study's context instead of typing in a table from one
benchmark. Prompts: haystacks of the suite's own generator (a seed no suite uses) at the
study's context, PROFILE_PROMPTS of each family in PROFILE_TASKS: one needle (pass key),
several look-alike needles (multikey), where deep layers must tell the asked key's block from
its neighbours', and chats whose order numbers are copied digit by digit (codes), which a
budget from the first two alone lost (RESULTS.md, "Attention profiles"); no gold answer is
read, so the profile needs no labels. One exact prefill
each (DenseCausalAttention); the figures come from the last PROBE_QUERIES prompt positions
(the question and the answer's opening, where retrieval happens), per layer:

- older_mass: attention mass on older blocks (after the sinks, before the window, in whole
  blocks as the cache pools them), the largest over query heads;
- blocks_needed: how deep into the selector's ranking a KV head must read so that no query head
  of it leaves more than MISSED_MASS of its attention on blocks not read, the largest over KV
  heads and probe positions (a budget bounds every query's error, not the mean query's: the
  mean's budget kept 0.41 of codes' retention). The ranking is the runtime's default
  index, key bounds in the model's basis (Quest; kernels/selection/blocks.py): a block scores
  the upper bound of q.k over its keys, a KV head takes its query heads' largest. Ranking by
  the attention mass itself (an oracle no index has) asks fewer blocks, and a start at such
  budgets lost multikey and codes (RESULTS.md, "Attention profiles");
- choice_overlap: the share of those blocks that the query REUSE_DISTANCE positions earlier
  would read at the same depth of its own ranking (a choice reused for several positions,
  LServe-style, loses little where it is high);
- key_outlier: each KV head's largest per-channel key magnitude over its median channel's
  (post-RoPE keys, as cached), the largest over heads: channel outliers want per-channel key
  scales (KIVI) or a rotation.

Figures are averaged over the prompts. The profile is cached by the model files' content, the
runtime settings, the geometry and the code (a few prefills the first time, free afterwards).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvtune.autotune.cache import JsonCache, code_key
from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks import TASKS, GenContext
from kvtune.autotune.search.sensitivity import RuntimeSettings
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.model import DecoderModel, DenseCausalAttention
from kvtune.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PROFILE_TASKS = ("passkey", "multikey", "codes")
PROFILE_SEED = 7919  # no suite draws from it
PROFILE_PROMPTS = 2  # of each task
PROBE_QUERIES = 8
REUSE_DISTANCE = 4
MISSED_MASS = 0.05
ATTENTION_CODE = ("kvtune.runtime.model", "kvtune.autotune.evaluation.tasks", __name__)


@dataclass(frozen=True)
class Geometry:
    """How the cache splits a context: exact sinks and window, older blocks of block_size."""

    context: int
    sinks: int
    window: int
    block_size: int

    def older_blocks(self, tokens: int) -> int:
        """Whole blocks between the sinks and the window of the last of `tokens` positions."""
        return max(0, tokens - self.sinks - self.window) // self.block_size


@dataclass(frozen=True)
class AttentionProfile:
    """Per-layer figures (module docstring), measured at `geometry`."""

    geometry: Geometry
    older_mass: tuple[float, ...]
    blocks_needed: tuple[float, ...]
    choice_overlap: tuple[float, ...]
    key_outlier: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionProfile:
        figures = {k: tuple(v) for k, v in data.items() if k != "geometry"}
        return cls(Geometry(**data["geometry"]), **figures)


def _bound_scores(
    query: torch.Tensor, high: torch.Tensor, low: torch.Tensor, group: int
) -> torch.Tensor:
    """[Hkv, blocks]: what the bounds index scores each older block by for one query [Hq, D],
    from the blocks' per-channel key maxima and minima [blocks, Hkv, D]: each query head's upper
    bound of q.k, the largest over a KV head's query heads."""
    per_head = torch.einsum("hd,bhd->hb", query.clamp(min=0), high.repeat_interleave(group, 1))
    per_head += torch.einsum("hd,bhd->hb", query.clamp(max=0), low.repeat_interleave(group, 1))
    return per_head.view(-1, group, per_head.shape[-1]).amax(1)


def _blocks_to_read(
    block_mass: torch.Tensor, scores: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From one query's older-block masses [Hq, blocks] and the selector's scores [Hkv, blocks]:
    each KV head's blocks in the order it reads them ([Hkv, blocks], best score first) and how
    many it must read ([Hkv]) so that no query head leaves more than MISSED_MASS unread."""
    heads, blocks = block_mass.shape
    per_kv = block_mass.view(heads // group, group, blocks)
    order = scores.argsort(dim=-1, descending=True)
    ordered = per_kv.gather(2, order[:, None, :].expand(-1, group, -1))
    total = per_kv.sum(-1, keepdim=True)
    # unread[h, g, n]: what query head g leaves unread after its KV head's first n blocks
    read = torch.cat([torch.zeros_like(total), ordered.cumsum(-1)], dim=-1)
    unread = (total - read).amax(1)  # [Hkv, blocks + 1]
    needed = (unread > MISSED_MASS).sum(-1)
    return order, needed


def layer_figures(
    q: torch.Tensor, k: torch.Tensor, geometry: Geometry
) -> tuple[float, float, float, float]:
    """(older_mass, blocks_needed, choice_overlap, key_outlier) of one layer from its post-RoPE
    queries [N, Hq, D] and keys [N, Hkv, D] over one whole prompt."""
    tokens, heads, dim = q.shape
    group = heads // k.shape[1]
    magnitude = k.abs().amax(0).float()  # [Hkv, D]
    outlier = (magnitude.amax(-1) / magnitude.median(-1).values).amax().item()
    blocks = geometry.older_blocks(tokens)
    if blocks == 0:
        return 0.0, 0.0, 1.0, outlier
    start = geometry.sinks
    end = start + blocks * geometry.block_size
    last = torch.arange(tokens - PROBE_QUERIES, tokens, device=q.device)
    keys = k.repeat_interleave(group, dim=1).float()
    logits = torch.einsum("phd,nhd->phn", q[last].float(), keys) / math.sqrt(dim)
    future = torch.arange(tokens, device=q.device)[None, None, :] > last[:, None, None]
    logits.masked_fill_(future, -math.inf)
    probs = logits.softmax(-1)
    block_mass = probs[:, :, start:end].unflatten(-1, (blocks, geometry.block_size)).sum(-1)
    older = block_mass.sum(-1).amax(-1).mean().item()
    block_keys = k[start:end].float().unflatten(0, (blocks, geometry.block_size))
    high, low = block_keys.amax(1), block_keys.amin(1)  # [blocks, Hkv, D]
    picks = [
        _blocks_to_read(mass, _bound_scores(q[position].float(), high, low, group), group)
        for position, mass in zip(last.tolist(), block_mass, strict=True)
    ]
    needed = torch.stack([n for _, n in picks]).float()  # [P, Hkv]
    order_now, needed_now = picks[-1]
    order_before = picks[-1 - REUSE_DISTANCE][0]
    overlaps = []
    for head, count in enumerate(needed_now.tolist()):
        if count:
            now = set(order_now[head, :count].tolist())
            overlaps.append(len(now & set(order_before[head, :count].tolist())) / count)
    overlap = sum(overlaps) / len(overlaps) if overlaps else 1.0
    return older, needed.amax().item(), overlap, outlier


def profile_prompts(tokenizer: Tokenizer, context: int) -> list[list[int]]:
    """Token ids of the profile's haystacks, each ending where its answer is due."""
    prompts = []
    for task in PROFILE_TASKS:
        gen = GenContext(random.Random(PROFILE_SEED), tokenizer, context)
        rows = TASKS[task].build(gen, TaskSize(docs=PROFILE_PROMPTS, questions=1))
        prompts += [tokenizer.encode(row["context"]) for row in rows]
    return prompts


def prompt_figures(
    model: DecoderModel, ids: list[int], geometry: Geometry
) -> list[tuple[float, ...]]:
    """Each layer's figures over one prompt, from one exact prefill."""
    rows: list[tuple[float, ...]] = []
    dense = DenseCausalAttention([len(ids)])

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows.append(layer_figures(q, k, geometry))
        return dense(layer, q, k, v)

    device = model.embed_tokens.weight.device
    with torch.no_grad():
        model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), attention)
    return rows


def measure_attention(
    folder: Path, geometry: Geometry, runtime: RuntimeSettings
) -> AttentionProfile:
    """The figures of every layer averaged over the profile's prompts."""
    model = DecoderModel.from_checkpoint(folder, runtime.dtype, runtime.device)
    prompts = profile_prompts(Tokenizer.from_folder(folder), geometry.context)
    figures = torch.tensor([prompt_figures(model, ids, geometry) for ids in prompts])
    means = figures.mean(0)  # [layers, figures]
    return AttentionProfile(geometry, *(tuple(column.tolist()) for column in means.T))


def attention_key(folder: Path, geometry: Geometry, runtime: RuntimeSettings) -> dict[str, Any]:
    return {
        "kind": "attention",
        "model": model_fingerprint(folder),
        "runtime": vars(runtime),
        "geometry": asdict(geometry),
        "code": code_key(*ATTENTION_CODE),
    }


def attention_profile(
    folder: Path, geometry: Geometry, runtime: RuntimeSettings, cache: JsonCache
) -> AttentionProfile:
    """The cached profile of a model at `geometry`, measured on first use."""
    key = attention_key(folder, geometry, runtime)
    cached = cache.get(key)
    if cached is not None:
        return AttentionProfile.from_dict(cached)
    logger.info("measuring the attention profile at %d tokens (cached)", geometry.context)
    profile = measure_attention(folder, geometry, runtime)
    cache.put(key, profile.to_dict())
    return profile
