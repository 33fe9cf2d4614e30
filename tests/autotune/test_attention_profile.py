"""The attention profile against transformers' own attention weights and cached keys on SmolLM2.

The figures are re-implemented here from their definitions (attention_profile.py's docstring)
with plain loops over transformers' eager attention probabilities and its cache's post-RoPE
keys, so neither the model nor the arithmetic of the code under test is the oracle.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

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


def reference_figures(probs: torch.Tensor, keys: torch.Tensor) -> tuple[float, ...]:
    """One layer's figures from attention probabilities [Hq, T, T] and keys [Hkv, T, D]."""
    heads, tokens, _ = probs.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    bs = GEOMETRY.block_size
    blocks = (tokens - GEOMETRY.sinks - GEOMETRY.window) // bs
    queries = range(tokens - PROBE_QUERIES, tokens)

    def block_mass(h: int, p: int, b: int) -> float:
        start = GEOMETRY.sinks + b * bs
        return float(probs[h, p, start : start + bs].sum())

    def reads(p: int, kv: int) -> list[int]:
        """kv's blocks by its largest query-head mass, just enough for every query head."""
        members = range(kv * group, (kv + 1) * group)
        masses = {b: max(block_mass(h, p, b) for h in members) for b in range(blocks)}
        order = sorted(masses, key=lambda b: -masses[b])
        total = {h: sum(block_mass(h, p, b) for b in range(blocks)) for h in members}
        for count in range(blocks + 1):
            chosen = order[:count]
            if all(
                total[h] - sum(block_mass(h, p, b) for b in chosen) <= MISSED_MASS for h in members
            ):
                return chosen
        raise AssertionError("unreachable: every block read leaves nothing unread")

    older = sum(
        max(sum(block_mass(h, p, b) for b in range(blocks)) for h in range(heads)) for p in queries
    ) / len(queries)
    chosen = {p: [reads(p, kv) for kv in range(kv_heads)] for p in queries}
    needed = sum(max(len(c) for c in chosen[p]) for p in queries) / len(queries)
    last, before = tokens - 1, tokens - 1 - REUSE_DISTANCE
    overlaps = []
    for kv in range(kv_heads):
        now = chosen[last][kv]
        if now:
            # the earlier query's order, cut at today's count
            members = range(kv * group, (kv + 1) * group)
            masses = {b: max(block_mass(h, before, b) for h in members) for b in range(blocks)}
            earlier = sorted(masses, key=lambda b: -masses[b])[: len(now)]
            overlaps.append(len(set(now) & set(earlier)) / len(now))
    overlap = sum(overlaps) / len(overlaps) if overlaps else 1.0
    outliers = []
    for kv in range(kv_heads):
        channel_max = keys[kv].abs().amax(0)
        outliers.append(float(channel_max.max() / channel_max.median()))
    return older, needed, overlap, max(outliers)


def test_figures_match_transformers_attention(folder, prompt):
    reference = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    ours = prompt_figures(DecoderModel.from_checkpoint(folder, "fp32"), prompt, GEOMETRY)
    assert len(ours) == len(out.attentions) == 30
    for layer, figures in enumerate(ours):
        keys = out.past_key_values.layers[layer].keys[0]
        expected = reference_figures(out.attentions[layer][0], keys)
        older, needed, overlap, outlier = figures
        assert older == pytest.approx(expected[0], abs=1e-4), layer
        assert needed == pytest.approx(expected[1], abs=0.126), layer  # one query off by a block
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
