"""The attention profile against transformers' own attention weights and cached keys on SmolLM2.

The figures are re-implemented here from their definitions (attention_profile.py's docstring)
with plain loops over transformers' eager attention probabilities, its cache's post-RoPE keys
and its post-RoPE queries (q_proj's output rotated by transformers' own RoPE), so neither the
model nor the arithmetic of the code under test is the oracle.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvtune.autotune.cache import JsonCache
from kvtune.autotune.search.attention_profile import (
    MISSED_MASS,
    PROBE_QUERIES,
    REUSE_DISTANCE,
    Geometry,
    attention_profile,
    profile_prompts,
    prompt_figures,
)
from kvtune.autotune.search.sensitivity import RuntimeSettings
from kvtune.runtime.model import DecoderModel
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

GEOMETRY = Geometry(context=640, sinks=16, window=64, block_size=16)


@pytest.fixture(scope="module")
def folder():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompt(folder) -> list[int]:
    return profile_prompts(Tokenizer.from_folder(folder), GEOMETRY.context)[0]


def reference_figures(
    probs: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor
) -> tuple[float, ...]:
    """One layer's figures from attention probabilities [Hq, T, T], queries [Hq, T, D] and
    keys [Hkv, T, D]."""
    heads, tokens, _ = probs.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    bs = GEOMETRY.block_size
    blocks = (tokens - GEOMETRY.sinks - GEOMETRY.window) // bs
    probes = range(tokens - PROBE_QUERIES, tokens)

    def block_mass(h: int, p: int, b: int) -> float:
        start = GEOMETRY.sinks + b * bs
        return float(probs[h, p, start : start + bs].sum())

    def bound(h: int, p: int, b: int) -> float:
        """The largest q.k any key of block b can give query head h: channel by channel the
        larger of q times the block's largest and smallest key."""
        start = GEOMETRY.sinks + b * bs
        block = keys[h // group, start : start + bs]
        q = queries[h, p]
        return float(torch.maximum(q * block.amax(0), q * block.amin(0)).sum())

    def ranking(p: int, kv: int) -> list[int]:
        """kv's older blocks, best bound (over its query heads) first."""
        members = range(kv * group, (kv + 1) * group)
        scores = {b: max(bound(h, p, b) for h in members) for b in range(blocks)}
        return sorted(scores, key=lambda b: -scores[b])

    def reads(p: int, kv: int) -> list[int]:
        """kv's blocks in the selector's ranking, just enough for every query head."""
        members = range(kv * group, (kv + 1) * group)
        order = ranking(p, kv)
        total = {h: sum(block_mass(h, p, b) for b in range(blocks)) for h in members}
        for count in range(blocks + 1):
            chosen = order[:count]
            if all(
                total[h] - sum(block_mass(h, p, b) for b in chosen) <= MISSED_MASS for h in members
            ):
                return chosen
        raise AssertionError("unreachable: every block read leaves nothing unread")

    older = sum(
        max(sum(block_mass(h, p, b) for b in range(blocks)) for h in range(heads)) for p in probes
    ) / len(probes)
    chosen = {p: [reads(p, kv) for kv in range(kv_heads)] for p in probes}
    needed = max(len(c) for p in probes for c in chosen[p])  # the worst probe's KV head
    last, before = tokens - 1, tokens - 1 - REUSE_DISTANCE
    overlaps = []
    for kv in range(kv_heads):
        now = chosen[last][kv]
        if now:
            earlier = ranking(before, kv)[: len(now)]  # the earlier query's, at today's depth
            overlaps.append(len(set(now) & set(earlier)) / len(now))
    overlap = sum(overlaps) / len(overlaps) if overlaps else 1.0
    outliers = []
    for kv in range(kv_heads):
        channel_max = keys[kv].abs().amax(0)
        outliers.append(float(channel_max.max() / channel_max.median()))
    return older, needed, overlap, max(outliers)


def rotated_queries(reference, prompt: list[int]) -> list[torch.Tensor]:
    """Each layer's post-RoPE queries [Hq, T, D]: q_proj's outputs, rotated by transformers."""
    config = reference.config
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    projected = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda m, i, out: projected.append(out))
        for layer in reference.model.layers
    ]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        reference(ids, use_cache=False)
        positions = torch.arange(len(prompt))[None]
        cos, sin = reference.model.rotary_emb(projected[0], positions)
        rotated = []
        for q in projected:
            q = q.view(1, len(prompt), heads, dim).transpose(1, 2)
            rotated.append(apply_rotary_pos_emb(q, q, cos, sin)[0][0])
    for hook in hooks:
        hook.remove()
    return rotated


def test_figures_match_transformers_attention(folder, prompt):
    reference = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    queries = rotated_queries(reference, prompt)
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    ours = prompt_figures(DecoderModel.from_checkpoint(folder, "fp32"), prompt, GEOMETRY)
    assert len(ours) == len(out.attentions) == 30
    for layer, figures in enumerate(ours):
        keys = out.past_key_values.layers[layer].keys[0]
        expected = reference_figures(out.attentions[layer][0], queries[layer], keys)
        older, needed, overlap, outlier = figures
        assert older == pytest.approx(expected[0], abs=1e-4), layer
        assert needed == pytest.approx(expected[1], abs=1), layer  # a near-tie: one block
        assert overlap == pytest.approx(expected[2], abs=0.05), layer
        assert outlier == pytest.approx(expected[3], rel=1e-3), layer
    # The prompt needs blocks somewhere and not everywhere, or the test would show nothing.
    needs = [figures[1] for figures in ours]
    blocks = (len(prompt) - GEOMETRY.sinks - GEOMETRY.window) // GEOMETRY.block_size
    assert min(needs) > 0 and max(needs) < blocks and len(set(needs)) > 5


def test_the_profile_is_measured_once_and_keyed_by_its_geometry(folder, tmp_path, monkeypatch):
    cache = JsonCache(tmp_path)
    runtime = RuntimeSettings()
    first = attention_profile(folder, GEOMETRY, runtime, cache)
    assert len(list(tmp_path.rglob("*.json"))) == 1

    def refuse(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr("kvtune.autotune.search.attention_profile.measure_attention", refuse)
    assert attention_profile(folder, GEOMETRY, runtime, cache) == first
    wider = Geometry(GEOMETRY.context, GEOMETRY.sinks, 128, GEOMETRY.block_size)
    with pytest.raises(AssertionError, match="measured again"):
        attention_profile(folder, wider, runtime, cache)
