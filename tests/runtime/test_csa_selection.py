"""CSA selection with a host tier, end to end on a tiny Llama (fp32).

Oracles: an uncompressed cache in the same format (selection of every older block must read
exactly what it holds), byte formulas written here, and the device cache a document leaves
behind compared bit for bit under two different questions.
"""

from __future__ import annotations

import torch

from runtime import LLM
from runtime.block_manager import HOST, MAIN
from runtime.policy import KVPolicy
from tests.runtime.test_engine import random_tokens, relative_error

BLOCK = 8
SELECT = KVPolicy(
    k_dtype="fp8",
    v_dtype="fp8",
    group_size=16,
    csa_ratio=4,
    csa_window=16,
    csa_sinks=4,
    csa_topk=2,
    csa_host=True,
    block_size=BLOCK,
)


def test_selecting_every_older_block_reads_the_uncompressed_cache(tiny_llama):
    """With csa_topk >= the older blocks, every query reads all of them exactly and no summary:
    the logits are those of the same format without compression, in prefill and in decode."""
    prompt = random_tokens(100, seed=11)
    exact = LLM(str(tiny_llama), policy=KVPolicy("fp8", "fp8", group_size=16, block_size=BLOCK))
    every = LLM(str(tiny_llama), policy=SELECT.replace(csa_topk=64), max_model_len=256)
    assert relative_error(every.prompt_logits(prompt), exact.prompt_logits(prompt)) <= 1e-5
    a = every.generate([prompt], max_new_tokens=12)[0].token_ids
    b = exact.generate([prompt], max_new_tokens=12)[0].token_ids
    assert a == b
    assert every.stats()["kv_fetched_bytes"] > 0


def test_selection_is_not_pooling_and_reads_what_it_selects(tiny_llama):
    """Fewer selected blocks change the logits (selection is not a no-op), and a selecting
    policy is nearer the exact cache than the same pooling without selection."""
    prompt = random_tokens(120, seed=12)
    exact = LLM(str(tiny_llama), policy=KVPolicy("fp8", "fp8", group_size=16, block_size=BLOCK))
    reference = exact.prompt_logits(prompt)
    select = LLM(str(tiny_llama), policy=SELECT, max_model_len=256).prompt_logits(prompt)
    pooled_policy = SELECT.replace(csa_topk=0, csa_host=False)
    pooled = LLM(str(tiny_llama), policy=pooled_policy, max_model_len=256).prompt_logits(prompt)
    assert relative_error(select, reference) > 1e-4
    assert relative_error(select, reference) < relative_error(pooled, reference)


def test_decode_fetches_at_most_topk_blocks_a_layer_and_reuses_staged_ones(tiny_llama):
    llm = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
    engine = llm.engine
    engine.add_request(random_tokens(80, seed=13), max_new_tokens=10)
    engine.step()  # prefill: reads the host tier in place, fetches nothing
    assert engine.stats()["kv_fetched_bytes"] == 0
    layers = llm.arch.num_layers
    block_bytes = engine.cache.host_allocated_bytes // engine.blocks.pools[HOST].num_blocks
    layer_block = block_bytes // layers  # every layer of the tiny model has one format
    fetched = []
    while engine.scheduler.has_work:
        engine.step()
        fetched.append(engine.stats()["kv_fetched_bytes"])
    steps = torch.diff(torch.tensor([0, *fetched]))
    assert int(steps[0]) > 0
    assert all(int(s) <= SELECT.csa_topk * layers * layer_block for s in steps)
    assert int(steps.sum()) < len(steps) * SELECT.csa_topk * layers * layer_block  # reuse


def test_the_cache_a_document_leaves_does_not_depend_on_the_question(tiny_llama):
    """Pooled summaries and host blocks of a document are the same bits whatever question
    follows it in the same prefill chunk; only the per-step choice uses the question."""
    document = random_tokens(96, seed=14)
    caches = []
    for seed in (15, 16):
        llm = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
        engine = llm.engine
        engine.add_request(document + random_tokens(20, seed=seed), max_new_tokens=2)
        engine.step()
        kv = next(iter(engine.scheduler.kv.values()))
        pooled = (len(document) - SELECT.csa_sinks - SELECT.csa_window) // BLOCK
        summaries = pooled * BLOCK // SELECT.csa_ratio
        layer = engine.cache.layers[1]
        summary_slots = torch.tensor(
            [kv.summary_blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(summaries)]
        )
        caches.append(
            (
                layer.k[MAIN].codes.flatten(0, 1)[summary_slots],
                layer.v[MAIN].codes.flatten(0, 1)[summary_slots],
                layer.k[HOST].codes[kv.host_blocks[:pooled]],
                layer.v[HOST].codes[kv.host_blocks[:pooled]],
            )
        )
    for first, second in zip(*caches, strict=True):
        assert torch.equal(first, second)


def test_prefill_from_a_remote_host_tier_reads_a_scratch_copy_with_the_same_result(
    tiny_llama, monkeypatch
):
    """Beside a GPU the host tier is pinned host memory, which the kernels cannot read: a
    prefill step copies the blocks its sequences hold into a scratch device pool. Forced here
    on the CPU, the logits are the same and the copied bytes are counted."""
    prompts = [random_tokens(100, seed=17), random_tokens(70, seed=18)]
    local = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
    expected = local.prompt_logits_batch(prompts)
    monkeypatch.setattr("runtime.kv_cache.KVCache._host_is_remote", lambda self, host: True)
    remote = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
    for got, want in zip(remote.prompt_logits_batch(prompts), expected, strict=True):
        assert torch.equal(got, want)
    assert remote.stats()["kv_fetched_bytes"] > 0
