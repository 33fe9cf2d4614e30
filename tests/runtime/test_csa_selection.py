"""CSA selection with a host tier, end to end on a tiny Llama (fp32).

Oracles: an uncompressed cache in the same format (selection of every older block must read
exactly what it holds), byte formulas written here, and the device cache a document leaves
behind compared bit for bit under two different questions.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import kvtune.runtime.engine as engine_module
from kvtune.kernels.cache.pool import KVPool
from kvtune.runtime import LLM
from kvtune.runtime.host_fetch import HostFetch
from kvtune.runtime.kv_cache import KVCache
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST, INDEX, MAIN, STAGE
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
STAGINGS = ["resident", "streamed"]


@pytest.mark.parametrize("summary", ["pre_rope", "none"])
def test_selecting_every_older_block_reads_the_uncompressed_cache(tiny_llama, summary):
    """With csa_topk >= the older blocks, every query reads all of them exactly and no summary:
    the logits are those of the same format without compression, in prefill and in decode."""
    prompt = random_tokens(100, seed=11)
    exact = LLM(str(tiny_llama), policy=KVPolicy("fp8", "fp8", group_size=16, block_size=BLOCK))
    every_policy = SELECT.replace(csa_topk=64, csa_summary=summary)
    every = LLM(str(tiny_llama), policy=every_policy, max_model_len=256)
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


def test_a_streamed_staging_pool_reads_the_same_blocks_and_refetches_them_every_step(tiny_llama):
    """Layers sharing one staging pool attend exactly what resident staging does (the same
    greedy tokens), and each decode step fetches every staged block in
    every layer: min(csa_topk, older blocks) x layers x one layer's block."""
    prompt = random_tokens(80, seed=14)
    resident = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
    streamed_llm = LLM(
        str(tiny_llama), policy=SELECT.replace(csa_staging="streamed"), max_model_len=256
    )
    outputs = [llm.generate([prompt], max_new_tokens=10)[0] for llm in (resident, streamed_llm)]
    assert outputs[0].token_ids == outputs[1].token_ids
    engine = streamed_llm.engine
    layers = streamed_llm.arch.num_layers
    layer_block = (
        engine.cache.host_allocated_bytes // engine.blocks.pools[HOST].num_blocks // layers
    )
    engine.add_request(prompt, max_new_tokens=6)
    engine.step()  # prefill: reads the host tier in place
    before = engine.stats()["kv_fetched_bytes"]
    steps = []
    while engine.scheduler.has_work:
        engine.step()
        after = engine.stats()["kv_fetched_bytes"]
        steps.append(after - before)
        before = after
    # 80 + t tokens: (80 + t - 4 sinks - 16 window) // 8 >= 7 older blocks, so 2 are staged.
    assert steps == [SELECT.csa_topk * layers * layer_block] * len(steps)
    # Staging blocks left the main pool (tests/runtime/test_engine.py counts the shared pool).
    assert engine.blocks.pools[MAIN].num_blocks < resident.engine.blocks.pools[MAIN].num_blocks


def _at_slots(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The codes and scales a pool holds at token slots."""
    held = [pool.codes.flatten(0, 1)[slots]]
    return held if pool.scales is None else [*held, pool.scales.flatten(0, 1)[slots]]


def _in_blocks(pool: KVPool, blocks: list[int]) -> list[torch.Tensor]:
    """The codes and scales a pool holds in whole blocks."""
    ids = torch.tensor(blocks, dtype=torch.long)
    return [pool.codes[ids]] if pool.scales is None else [pool.codes[ids], pool.scales[ids]]


def _slots(blocks: list[int], count: int) -> torch.Tensor:
    """Token slots of the first `count` vectors of a stream laid out in `blocks`."""
    return torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(count)])


def document_cache(llm: LLM, document: list[int]) -> list[torch.Tensor]:
    """After one prefill step, in every layer, K and V: the codes and scales of what the cache
    holds for the document's tokens (sinks, and the summaries, host-tier blocks and index slots
    of the older blocks made of document tokens only) and of the staging blocks (allocated,
    not yet written: prefill reads the host tier in place)."""
    engine = llm.engine
    kv = next(iter(engine.scheduler.kv.values()))
    policy = engine.policy
    older = (len(document) - policy.csa_sinks) // BLOCK  # blocks of document tokens only
    assert len(kv.host_blocks) >= older  # the question pushed them all out of the window
    assert kv.staging_blocks
    sink_slots = _slots([b.block_id for b in kv.sinks.blocks], policy.csa_sinks)
    summary_slots = _slots(kv.summary_blocks, older * BLOCK // policy.csa_ratio)
    index_slots = _slots(kv.index_blocks, older)
    held = []
    for layer in engine.cache.layers:
        for pools in (layer.k, layer.v):
            staging = pools[STAGE] if policy.streams_staging else pools[MAIN]
            held += _at_slots(pools[MAIN], sink_slots) + _at_slots(pools[MAIN], summary_slots)
            held += _in_blocks(pools[HOST], kv.host_blocks[:older])
            held += _at_slots(pools[INDEX], index_slots)
            held += _in_blocks(staging, kv.staging_blocks)
    return held


@pytest.mark.parametrize("staging", STAGINGS)
def test_the_cache_a_document_leaves_does_not_depend_on_the_question(tiny_llama, staging):
    """What a document's tokens leave in the cache (every layer's sinks, summaries, host-tier
    blocks and index bounds, codes and scales) and the staging blocks are the same bits
    whatever question follows it in the same prefill chunk: only the per-step choice uses the
    question."""
    document = random_tokens(96, seed=14)
    policy = SELECT.replace(csa_staging=staging)
    caches = []
    for seed in (15, 16):
        llm = LLM(str(tiny_llama), policy=policy, max_model_len=256)
        llm.engine.add_request(document + random_tokens(20, seed=seed), max_new_tokens=2)
        llm.engine.step()
        caches.append(document_cache(llm, document))
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
    monkeypatch.setattr(HostFetch, "host_is_remote", lambda self, host: True)
    remote = LLM(str(tiny_llama), policy=SELECT, max_model_len=256)
    for got, want in zip(remote.prompt_logits_batch(prompts), expected, strict=True):
        assert torch.equal(got, want)
    assert remote.stats()["kv_fetched_bytes"] > 0


QUEST = SELECT.replace(
    k_dtype="fp16", v_dtype="fp16", csa_summary="none", csa_topk=3, chunk_size=32
)


def quest_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    policy: KVPolicy,
    scale: float,
    topk: int | None = None,
    select_every: int = 1,
    rescore: int = 1,
) -> torch.Tensor:
    """[N, Hq, D]: attention without summaries from its definition (Quest). Query p reads the
    sinks, the window (the layout decode holds when p arrives: a block has left it once
    csa_window tokens before p follow it) and, per KV head, the topk (default csa_topk) older
    blocks with the
    largest score max over its query heads: with csa_index bounds sum_d max(q_d hi_d, q_d lo_d),
    hi / lo the per-channel key max / min of the block; with means q.m, m the mean of the
    block's keys. Nothing of the other older blocks. With select_every = N, the scores are
    those of the query at p - p % N (LServe's reused selection), over the blocks p sees. With
    rescore = R > 1 (two-stage), the R x topk best by that score are a shortlist, and the topk
    of it whose keys give the anchor's query heads the largest logit are read."""
    sinks, bs, window = policy.csa_sinks, policy.block_size, policy.csa_window
    topk = policy.csa_topk if topk is None else topk
    num_q, kv_heads, per_kv = q.shape[0], k.shape[1], q.shape[1] // k.shape[1]
    keys, values = k.half().float(), v.half().float()  # the fp16 cache
    out = torch.zeros_like(q)
    for p in range(num_q):
        older = max(0, p - sinks - window) // bs
        for h in range(kv_heads):
            seen = torch.zeros(p + 1, dtype=torch.bool)
            seen[:sinks] = True
            seen[sinks + older * bs :] = True
            blocks = keys[sinks : sinks + older * bs, h].view(older, bs, keys.shape[-1])
            queries = q[p, h * per_kv : (h + 1) * per_kv]  # [per_kv, D]
            anchor = q[p - p % select_every, h * per_kv : (h + 1) * per_kv]
            if policy.csa_index == "means":
                score = anchor @ blocks.mean(1).T  # [per_kv, older]
            else:
                score = torch.maximum(
                    anchor[:, None, :] * blocks.amax(1)[None],
                    anchor[:, None, :] * blocks.amin(1)[None],
                ).sum(-1)
            shortlist = score.amax(0).topk(min(rescore * topk, older)).indices
            if rescore > 1:
                exact = (anchor @ blocks[shortlist].flatten(0, 1).T).view(per_kv, -1, bs)
                best = exact.amax(-1).amax(0).topk(min(topk, len(shortlist))).indices
                shortlist = shortlist[best]
            for block in shortlist.tolist():
                seen[sinks + block * bs : sinks + (block + 1) * bs] = True
            logits = queries @ keys[: p + 1, h][seen].T * scale
            out[p, h * per_kv : (h + 1) * per_kv] = logits.softmax(-1) @ values[: p + 1, h][seen]
    return out


@pytest.mark.parametrize("index", ["bounds", "means"])
@pytest.mark.parametrize("index_dtype", ["auto", "fp16"])
def test_attention_without_summaries_reads_sinks_window_and_the_quest_selection(
    tiny_llama, index, index_dtype
):
    """The first layer's attention output over a chunked prefill equals the selection rule
    computed here from the q, k and v the attention received; no summaries are held. The key
    bounds or means live in the fp16 K/V pools (auto) or in a separate fp16 index: the same."""
    policy = QUEST.replace(csa_index=index, csa_index_dtype=index_dtype)
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=256)
    engine = llm.engine
    seen = []
    original = KVCache.attend

    def attend(self, layer, layout, q, k, v, scale):
        out = original(self, layer, layout, q, k, v, scale)
        if layer == 0:
            seen.append((q.clone(), k.clone(), v.clone(), out.clone(), scale))
        return out

    engine.cache.attend = attend.__get__(engine.cache)
    prompt = random_tokens(120, seed=19)
    engine.add_request(prompt, max_new_tokens=2)
    while len(seen) < -(-len(prompt) // QUEST.chunk_size):  # the prefill chunks
        engine.step()
    q, k, v, out = (torch.cat([part[i] for part in seen]) for i in range(4))
    expected = quest_attention(q, k, v, policy, seen[0][4])
    assert relative_error(out, expected) <= 1e-5
    kv = next(iter(engine.scheduler.kv.values()))
    assert kv.summary_blocks == [] and len(kv.host_blocks) == (120 - 4 - 16) // BLOCK
    assert len(kv.host_blocks) > QUEST.csa_topk  # the choice matters
    other = policy.replace(csa_index="bounds" if index == "means" else "means")
    assert relative_error(quest_attention(q, k, v, other, seen[0][4]), expected) > 1e-3


def prefill_and_decode(
    llm: LLM, prompt: list[int], steps: int
) -> tuple[dict[int, tuple], list[int]]:
    """Prefill prompt in QUEST's chunks, then decode `steps` steps: per layer of the tiny model,
    the (q, k, v, out) its attention received and returned over every step, concatenated,
    and the scale; and the bytes each decode step fetched."""
    engine = llm.engine
    seen: dict[int, list] = {0: [], 1: []}
    original = KVCache.attend

    def attend(self, layer, layout, q, k, v, scale):
        out = original(self, layer, layout, q, k, v, scale)
        seen[layer].append((q.clone(), k.clone(), v.clone(), out.clone()))
        return out

    engine.cache.attend = attend.__get__(engine.cache)
    engine.add_request(prompt, max_new_tokens=steps + 1)
    while len(seen[0]) < -(-len(prompt) // QUEST.chunk_size):
        engine.step()
    fetched = []
    for _ in range(steps):
        before = engine.stats()["kv_fetched_bytes"]
        engine.step()
        fetched.append(engine.stats()["kv_fetched_bytes"] - before)
    concatenated = {
        layer: (*(torch.cat([part[i] for part in parts]) for i in range(4)), llm.engine.scale)
        for layer, parts in seen.items()
    }
    return concatenated, fetched


def quest_error(recorded: tuple, policy: KVPolicy, **rule: int) -> float:
    """Relative error of a layer's recorded attention output (`prefill_and_decode`) against
    `quest_attention` over the same q, k and v with `rule` (topk, select_every)."""
    q, k, v, out, scale = recorded
    return relative_error(out, quest_attention(q, k, v, policy, scale, **rule))


@pytest.mark.parametrize(
    ("budgets", "staging", "backend"),
    [
        *((budgets, staging, "torch") for budgets in [(1, 3), (0, 2)] for staging in STAGINGS),
        # The Triton path: decode steps score the index with the kernel that reads it in place.
        ((1, 3), "resident", "triton"),
    ],
)
def test_each_layer_reads_its_own_budget_in_prefill_and_decode(
    tiny_llama, budgets, staging, backend
):
    """Per-layer budgets (layer_csa_topk, PyramidKV-style): each layer's attention output over
    a chunked prefill and decode steps equals the Quest rule computed here with that layer's
    budget (0: sinks and window only), and a decode step fetches min(budget, older blocks)
    blocks in each layer."""
    policy = QUEST.replace(csa_topk=0, layer_csa_topk=budgets, csa_staging=staging)
    assert policy.csa_topk == max(budgets)
    llm = LLM(str(tiny_llama), policy=policy, backend=backend, max_model_len=256)
    prompt = random_tokens(120, seed=20)
    seen, fetched = prefill_and_decode(llm, prompt, 3)
    for layer, budget in enumerate(budgets):
        assert quest_error(seen[layer], policy, topk=budget) <= 1e-5, layer
    heads = llm.arch.num_kv_heads
    vector = 2 * heads * llm.arch.head_dim * 2  # K and V of one token, 2 bytes an element
    older = (len(prompt) - QUEST.csa_sinks - QUEST.csa_window) // BLOCK  # 12, more than budgets
    every_block = sum(min(b, older) for b in budgets) * BLOCK * vector
    if staging == "streamed":
        assert fetched == [every_block] * 3
    else:
        assert 0 < fetched[0] <= every_block and all(f <= every_block for f in fetched)


@pytest.mark.parametrize(
    ("everies", "staging", "backend"),
    [
        ((3, 3), "resident", "torch"),
        ((3, 3), "streamed", "torch"),
        ((3, 3), "resident", "triton"),
        # Per layer: the first reuses, the second chooses at every query.
        ((3, 1), "resident", "torch"),
    ],
)
def test_a_reused_choice_is_the_quest_selection_of_the_anchor_query(
    tiny_llama, everies, staging, backend
):
    """csa_select_every = 3 (per layer with layer_csa_select_every): every layer's attention
    output over a chunked prefill (chunks of 32 split anchors from their queries) and nine
    decode steps equals the Quest rule computed here with each query scored by the query at its
    layer's anchor; a decode step between anchors without a new older block reuses the staged
    choice: where every layer reuses, a resident pool fetches nothing, a streamed one
    refetches it."""
    policy = QUEST.replace(layer_csa_select_every=everies, csa_staging=staging)
    llm = LLM(str(tiny_llama), policy=policy, backend=backend, max_model_len=256)
    prompt = random_tokens(120, seed=21)
    seen, fetched_by_step = prefill_and_decode(llm, prompt, 9)
    for layer, every in enumerate(everies):
        assert quest_error(seen[layer], policy, select_every=every) <= 1e-5, layer
        if every > 1:  # the anchors matter: the every-query rule is far from what was read
            assert quest_error(seen[layer], policy) > 1e-4, layer
    if min(everies) == 1:
        return
    fetched = dict(enumerate(fetched_by_step, start=len(prompt)))  # by query position
    sinks, window = QUEST.csa_sinks, QUEST.csa_window
    new_block = {p for p in fetched if (p - sinks - window) % BLOCK == 0}
    reused = [p for p in fetched if p % 3 and p not in new_block]
    assert reused == [121, 122, 125, 127, 128]
    if staging == "resident":
        assert all(fetched[p] == 0 for p in reused)
        assert fetched[len(prompt)] > 0
    else:
        assert len(set(fetched.values())) == 1 and fetched[len(prompt)] > 0


@pytest.mark.parametrize(
    ("index", "index_dtype", "staging"),
    [
        ("bounds", "auto", "resident"),
        ("bounds", "fp16", "streamed"),
        ("means", "auto", "resident"),
    ],
)
def test_a_rescored_choice_is_the_shortlist_best_by_exact_keys(
    tiny_llama, index, index_dtype, staging
):
    """csa_rescore = 3: every layer's attention output over a chunked prefill and decode steps
    equals the two-stage rule computed here (3 x topk shortlisted by the index, topk of them
    kept by their keys' largest logit), and neither one-stage rule (topk, or 3 x topk); each
    decode step reads the keys of at least one head's shortlist and at most every head's
    from the host tier, and fetches at most topk blocks a KV head."""
    policy = QUEST.replace(
        csa_topk=2,
        csa_rescore=3,
        csa_index=index,
        csa_index_dtype=index_dtype,
        csa_staging=staging,
    )
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=256)
    prompt = random_tokens(120, seed=23)
    engine = llm.engine
    seen, _ = prefill_and_decode(llm, prompt, 3)
    for layer in seen:
        assert quest_error(seen[layer], policy, rescore=3) <= 1e-5, layer
        assert quest_error(seen[layer], policy) > 1e-4, layer
        assert quest_error(seen[layer], policy, topk=6) > 1e-4, layer
    heads, layers = llm.arch.num_kv_heads, llm.arch.num_layers
    key_block = BLOCK * heads * llm.arch.head_dim * 2  # fp16 keys of one block, every head
    read = engine.stats()["kv_rescored_bytes"] / key_block / 3 / layers  # blocks a layer a step
    assert 6 <= read <= 6 * heads


def test_a_rotated_cache_rescores_with_rotated_queries(tiny_llama):
    """With rotated int8 K/V and a separate fp16 index in the model's basis, the shortlist is
    scored by unrotated queries and its host-tier keys by rotated ones: each layer's output is
    near the two-stage rule computed here in the model's basis (int8 rounding apart), and far
    from both one-stage rules, which a query in the wrong basis lands on."""
    policy = QUEST.replace(
        k_dtype="int8",
        v_dtype="int8",
        group_size=16,
        rotation="hadamard",
        csa_index_dtype="fp16",
        csa_topk=2,
        csa_rescore=3,
    )
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=256)
    seen, _ = prefill_and_decode(llm, random_tokens(120, seed=23), 3)
    for layer in seen:
        two_stage = quest_error(seen[layer], policy, rescore=3)
        one_stage = min(quest_error(seen[layer], policy), quest_error(seen[layer], policy, topk=6))
        assert two_stage < 0.1 and two_stage < one_stage / 2, (layer, two_stage, one_stage)


def sampled_logits(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """Per prompt, the logits [new_tokens, vocab] its greedy generation sampled from."""
    engine = llm.engine
    captured: dict[int, list[torch.Tensor]] = defaultdict(list)
    sample, project = engine._sample, engine.model.logits

    def recording_sample(batch, hidden, rows):
        ids = [item.seq.seq_id for item in batch if engine_module._samples(item.seq)]

        def logits(selected_hidden):
            out = project(selected_hidden)
            for seq_id, row in zip(ids, out, strict=True):
                captured[seq_id].append(row.float())
            return out

        engine.model.logits = logits
        try:
            return sample(batch, hidden, rows)
        finally:
            engine.model.logits = project

    engine._sample = recording_sample
    try:
        results = llm.generate(prompts, max_new_tokens=new_tokens)
    finally:
        del engine._sample  # the class's again
    assert all(len(r.token_ids) == new_tokens for r in results)
    return [torch.stack(captured[seq_id]) for seq_id in sorted(captured)]


def test_batched_decode_with_reused_choices_equals_one_sequence_at_a_time(tiny_llama):
    """Sequences of a batch reach their anchors and gain older blocks at different steps: a
    step that reselects for one rescores the others by their own anchors, and a step that
    reuses hides the summaries of each one's own choice, so each sequence decodes the logits
    it decodes alone (and not those of a choice made every step)."""
    policy = SELECT.replace(csa_select_every=3)
    prompts = [random_tokens(n, seed=n) for n in (70, 85, 101)]
    alone = LLM(str(tiny_llama), policy=policy, max_model_len=256, max_num_seqs=1)
    expected = [sampled_logits(alone, [p], 20)[0] for p in prompts]
    batched = LLM(str(tiny_llama), policy=policy, max_model_len=256, max_num_seqs=3)
    for got, want in zip(sampled_logits(batched, prompts, 20), expected, strict=True):
        assert relative_error(got, want) <= 1e-5
    every_step = LLM(str(tiny_llama), policy=SELECT, max_model_len=256, max_num_seqs=1)
    assert (
        max(
            relative_error(sampled_logits(every_step, [p], 20)[0], want)
            for p, want in zip(prompts, expected, strict=True)
        )
        > 1e-3
    )
