"""Importance-kept CSA blocks (policy.csa_keep), end to end on a tiny Llama (fp32).

Oracles: the keep rule recomputed here from its definition (dense softmax over the window each
query saw, from the q and k the attention received), the block count from the policy's
documented formula, the groups a document decides under two different questions, and the
uncompressed cache (kept blocks bring the logits nearer to it than pooling alone).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvtune.runtime import LLM
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_cache import KVCache
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import MAIN
from tests.runtime.conftest import build_tiny_model
from tests.runtime.test_engine import random_tokens, relative_error

BLOCK = 8
GROUP = 8  # blocks per keep group, as documented in KVPolicy
KEEP = KVPolicy(
    k_dtype="fp16",
    v_dtype="fp16",
    csa_ratio=4,
    csa_window=56,
    csa_sinks=4,
    csa_keep=0.25,
    block_size=BLOCK,
    chunk_size=32,
)


def run_prompt(
    folder, policy: KVPolicy, prompt: list[int], record: bool = False, values: bool = False
):
    """Prefill prompt (chunked), returning the engine, the sequence's blocks and, if asked,
    each layer's post-RoPE q and k (and v) as attention received them, in position order."""
    llm = LLM(str(folder), policy=policy, max_model_len=512)
    engine = llm.engine
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    if record:
        original = KVCache.attend

        def attend(self, layer, layout, q, k, v, scale):
            seen.setdefault(layer, []).append((q.clone(), k.clone(), v.clone()))
            return original(self, layer, layout, q, k, v, scale)

        engine.cache.attend = attend.__get__(engine.cache)
    engine.add_request(prompt, max_new_tokens=2)
    while engine.scheduler.has_work and not any(s.output_ids for s in engine.scheduler.running):
        engine.step()
    kv = next(iter(engine.scheduler.kv.values()))
    recorded = {
        layer: tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))
        for layer, parts in seen.items()
    }
    if not values:
        recorded = {layer: (q, k) for layer, (q, k, _) in recorded.items()}
    return llm, kv, recorded


def kept_by_definition(
    q: torch.Tensor, k: torch.Tensor, policy: KVPolicy, pooled: int, scale: float
) -> torch.Tensor:
    """[groups * kept, KV heads]: the older blocks each KV head keeps, from the rule stated in
    KVPolicy: per group of 8 older blocks, decided when its first block leaves the window, the
    blocks with the most window attention per query from the queries before that point."""
    sinks, bs, window = policy.csa_sinks, policy.block_size, policy.csa_window
    kv_heads, per_kv = k.shape[1], q.shape[1] // k.shape[1]
    keys = k.half().float()  # the fp16 cache
    received = torch.zeros(kv_heads, pooled + GROUP, dtype=torch.float64)

    def exit_of(block: int) -> int:
        return sinks + (block + 1) * bs + window

    for p in range(q.shape[0]):
        window_tokens = [
            t for t in range(sinks, p + 1) if exit_of((t - sinks) // bs) > p
        ]  # older tokens the query still sees exact
        for head in range(kv_heads):
            logits = torch.stack(
                [
                    (q[p, head * per_kv + g].double() @ keys[window_tokens, head].double().T)
                    * scale
                    for g in range(per_kv)
                ]
            )
            mass = torch.softmax(logits, dim=-1).sum(0)
            for t, m in zip(window_tokens, mass.tolist(), strict=True):
                block = (t - sinks) // bs
                if block < received.shape[1] and p < exit_of(block - block % GROUP):
                    received[head, block] += m
    kept = []
    for first in range(0, pooled, GROUP):
        decided = exit_of(first)
        blocks = range(first, first + GROUP)
        seen = torch.tensor([decided - (sinks + b * bs) for b in blocks], dtype=torch.float64)
        per_query = received[:, first : first + GROUP] / seen
        best = per_query.topk(round(policy.csa_keep * GROUP), dim=1).indices.sort(1).values
        kept.append((first + best).T)
    return torch.cat(kept)


def test_each_head_keeps_the_blocks_with_the_most_window_attention(tiny_llama):
    prompt = random_tokens(200, seed=21)
    llm, kv, recorded = run_prompt(tiny_llama, KEEP, prompt, record=True)
    pooled = (len(prompt) - KEEP.csa_sinks - KEEP.csa_window) // BLOCK
    scale = 1 / math.sqrt(llm.arch.head_dim)
    for layer in (0, llm.arch.num_layers - 1):
        q, k = recorded[layer]
        expected = kept_by_definition(q[: len(prompt)], k[: len(prompt)], KEEP, pooled, scale)
        assert torch.equal(kv.kept[layer].cpu(), expected), layer


def test_kept_blocks_count_as_the_formula_says_and_hold_the_chosen_codes(tiny_llama):
    """csa_keep * 8 device blocks per group of 8 pooled blocks, counted from the group's first,
    each KV head's slice a bit-exact copy of the block it chose: the fp16 codes of the keys
    and values attention received at those positions."""
    prompt = random_tokens(230, seed=22)
    llm, kv, recorded = run_prompt(tiny_llama, KEEP, prompt, record=True, values=True)
    pooled = (len(prompt) - KEEP.csa_sinks - KEEP.csa_window) // BLOCK
    kept_per_group = int(KEEP.csa_keep * GROUP)
    assert len(kv.keep_blocks) == kept_per_group * -(-pooled // GROUP)
    for layer in range(llm.arch.num_layers):
        pools = llm.engine.cache.layers[layer]
        _, keys, values = recorded[layer]
        for slot, per_head in enumerate(kv.kept[layer].tolist()):
            for head, older in enumerate(per_head):
                start = KEEP.csa_sinks + older * BLOCK
                for pool, source in ((pools.k[MAIN], keys), (pools.v[MAIN], values)):
                    want = source[start : start + BLOCK, head].half()
                    got = pool.codes[kv.keep_blocks[slot], :, head]
                    assert torch.equal(got, want), (layer, slot, head)


@pytest.fixture(scope="module")
def sharp_llama(tmp_path_factory) -> Path:
    """The tiny Llama with its q and k projections x10: at the default weights (std 0.02) every
    window is attended almost uniformly and the keep choices follow positions alone, whatever
    the tokens; here what a query attends decides them."""
    folder = build_tiny_model(tmp_path_factory.mktemp("sharp"), "llama")
    weights = folder / "model.safetensors"
    with safe_open(weights, "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * 10
    save_file(tensors, weights, metadata=metadata)
    return folder


def test_a_document_decides_its_groups_alone_and_the_question_the_rest(sharp_llama):
    """Keeping is causal. Groups decided within a document keep the same blocks, bit for bit in
    every layer, whatever question follows it in the same prefill chunks; a group still in the
    window when the document ends is decided by the rule over the whole prompt, the question's
    queries included, so two questions keep different blocks there."""
    document = random_tokens(140, seed=23)
    decided = [
        KEEP.csa_sinks + (first + 1) * BLOCK + KEEP.csa_window for first in range(0, 24, GROUP)
    ]
    in_document = sum(1 for at in decided if at <= len(document))
    assert 0 < in_document < len(decided)  # groups decided in the document and after it
    slots = in_document * int(KEEP.csa_keep * GROUP)
    caches, later = [], []
    for seed in (24, 25):
        prompt = document + random_tokens(60, seed=seed)
        assert decided[in_document] <= len(prompt)  # the next group is decided in the question
        llm, kv, recorded = run_prompt(sharp_llama, KEEP, prompt, record=True)
        pooled = (len(prompt) - KEEP.csa_sinks - KEEP.csa_window) // BLOCK
        scale = 1 / math.sqrt(llm.arch.head_dim)
        cache = []
        for layer, pools in enumerate(llm.engine.cache.layers):
            q, k = recorded[layer]
            kept = kv.kept[layer].cpu()
            expected = kept_by_definition(q[: len(prompt)], k[: len(prompt)], KEEP, pooled, scale)
            assert torch.equal(kept, expected), layer
            blocks = kv.keep_blocks[:slots]
            cache += [kept[:slots], pools.k[MAIN].codes[blocks], pools.v[MAIN].codes[blocks]]
            later.append(kept[slots:])
        caches.append(cache)
    for first, second in zip(*caches, strict=True):
        assert torch.equal(first, second)
    layers = len(later) // 2
    assert any(not torch.equal(a, b) for a, b in zip(later[:layers], later[layers:], strict=True))


def test_kept_blocks_bring_the_logits_nearer_the_exact_cache_than_pooling_alone(tiny_llama):
    prompt = random_tokens(220, seed=26)
    exact = LLM(str(tiny_llama), policy=KVPolicy("fp16", "fp16", block_size=BLOCK))
    reference = exact.prompt_logits(prompt)
    kept = LLM(str(tiny_llama), policy=KEEP.replace(csa_keep=0.75), max_model_len=512)
    pooled = LLM(str(tiny_llama), policy=KEEP.replace(csa_keep=0.0), max_model_len=512)
    kept_error = relative_error(kept.prompt_logits(prompt), reference)
    pooled_error = relative_error(pooled.prompt_logits(prompt), reference)
    assert 1e-5 < kept_error < pooled_error


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"csa_keep": 0.3}, "policy.csa_keep"),
        ({"csa_keep": 1.0}, "policy.csa_keep"),
        ({"csa_keep": True}, "policy.csa_keep"),
        ({"csa_keep": 0.25, "csa_ratio": 1}, "policy.csa_keep"),
        ({"csa_keep": 0.25, "csa_topk": 2, "csa_host": True}, "policy.csa_keep"),
        ({"csa_keep": 0.25, "csa_window": 48}, "policy.csa_window"),
        ({"csa_keep": 0.25, "recent_unquantized": 9}, "policy.recent_unquantized"),
    ],
)
def test_bad_keep_settings_get_one_line_errors(changes, field):
    with pytest.raises(ConfigError) as error:
        KEEP.replace(**changes)
    assert error.value.field == field
    assert "\n" not in str(error.value)


def test_triton_backend_reads_kept_blocks_like_torch(tiny_llama):
    """The stream kernel shows each kept block through its per-head mask, as the torch path
    does; the keep decisions (made on the torch path for both) are the same."""
    policy = KEEP.replace(k_dtype="fp8", v_dtype="fp8", csa_keep=0.5)
    tokens = random_tokens(110, seed=27)
    reference = LLM(str(tiny_llama), policy=policy, max_model_len=160).prompt_logits(tokens)
    triton = LLM(str(tiny_llama), policy=policy, backend="triton", max_model_len=160)
    assert relative_error(triton.prompt_logits(tokens), reference) < 1e-4
    torch_gen = LLM(str(tiny_llama), policy=policy, max_model_len=160).generate([tokens[:90]], 6)
    assert triton.generate([tokens[:90]], 6)[0].token_ids == torch_gen[0].token_ids
