"""The engine against transformers, the byte arithmetic, and itself across backends."""

from __future__ import annotations

import random

import pytest
import torch

from kvtune.runtime import LLM
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_bytes import host_kv_bytes_per_sequence, kv_bytes_per_sequence
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.pool_kinds import HOST
from tests.runtime.conftest import TINY_VOCAB


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def transformers_logits(folder, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(n: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


AUTO_CHUNKED = KVPolicy(k_dtype="auto", v_dtype="auto", block_size=8, chunk_size=16)


def test_auto_prompt_logits_match_transformers(tiny_model):
    tokens = random_tokens(45)
    llm = LLM(str(tiny_model), policy=AUTO_CHUNKED, max_model_len=128)
    logits = llm.prompt_logits(tokens)
    assert logits.shape == (45, TINY_VOCAB)
    assert relative_error(logits, transformers_logits(tiny_model, tokens)) < 1e-4


def test_prompt_logits_from_a_start_equal_the_tail_of_all_logits(tiny_model):
    """Starts inside and across chunks (chunk 16) in one batch: the rows are the same (up to
    BLAS blocking of a shorter projection: float32 rounding)."""
    prompts = [random_tokens(45), random_tokens(30, seed=1)]
    llm = LLM(str(tiny_model), policy=AUTO_CHUNKED, max_model_len=128)
    full = llm.prompt_logits_batch(prompts)
    tails = llm.prompt_logits_batch(prompts, starts=[21, 0])
    assert tails[0].shape == (45 - 21, TINY_VOCAB)
    torch.testing.assert_close(tails[0], full[0][21:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tails[1], full[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="prompt_logits_from"):
        llm.prompt_logits_batch(prompts, starts=[45, 0])
    with pytest.raises(ConfigError, match="starts"):
        llm.prompt_logits_batch(prompts, starts=[0])


@pytest.mark.slow
def test_auto_prompt_logits_match_transformers_on_smollm2(smollm2_folder):
    llm = LLM("smollm2-135m", policy=KVPolicy("auto", "auto", chunk_size=64), max_model_len=512)
    tokens = llm.tokenizer.encode("The capital of France is Paris. " * 12)
    ref = transformers_logits(smollm2_folder, tokens)
    assert relative_error(llm.prompt_logits(tokens), ref) < 1e-4


@pytest.mark.slow
def test_fp16_kv_greedy_generation_reproduces_transformers(smollm2_folder):
    from transformers import AutoModelForCausalLM

    llm = LLM("smollm2-135m", policy=KVPolicy("fp16", "fp16"), max_model_len=512)
    prompt = "Write one sentence about the sea."
    [result] = llm.generate([prompt], max_new_tokens=16, chat=True)
    ids = llm.encode_prompt(prompt, chat=True)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    expected = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=list(llm.tokenizer.eos_token_ids),
    )[0, len(ids) :].tolist()
    assert result.token_ids == expected


@pytest.mark.slow
def test_quantized_and_compressed_policies_degrade_in_order():
    """fp8 stays closer to the exact logits than fp4; compression stays bounded."""
    exact = LLM("smollm2-135m", policy=KVPolicy("auto", "auto"), max_model_len=1024)
    tokens = exact.tokenizer.encode(
        " ".join(f"Item {i} costs {i * 7 % 100} dollars." for i in range(60))
    )
    reference = exact.prompt_logits(tokens)

    def kl_to_reference(policy: KVPolicy) -> float:
        logits = LLM("smollm2-135m", policy=policy, max_model_len=1024).prompt_logits(tokens)
        log_p = torch.log_softmax(reference, -1)
        log_q = torch.log_softmax(logits, -1)
        return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())

    fp8 = kl_to_reference(KVPolicy("fp8", "fp8", group_size="tensor"))
    fp4 = kl_to_reference(KVPolicy("fp4", "fp4", group_size=32))
    csa = kl_to_reference(KVPolicy("fp8", "fp8", group_size="tensor", csa_ratio=4, csa_window=128))
    assert 0 < fp8 < fp4
    assert fp8 < 0.05 and fp4 < 1.0 and csa < 1.0


# CSA selection with one block a query: 40-token prompts pool two, so the choice matters.
SELECTING = KVPolicy(
    "fp8",
    "fp8",
    group_size=16,
    csa_ratio=4,
    csa_window=16,
    csa_sinks=4,
    csa_topk=1,
    csa_host=True,
    block_size=8,
    chunk_size=16,
)
POLICIES_FOR_BYTES = [
    KVPolicy("auto", "auto", block_size=8, chunk_size=16),
    KVPolicy("int4", "int2", group_size=16, recent_unquantized=20, block_size=8, chunk_size=16),
    KVPolicy("int8", "int4", group_size=32, k_scale_axis="channel", block_size=8, chunk_size=16),
    KVPolicy("fp8", "fp4", group_size=16, scale_dtype="e4m3", block_size=8, chunk_size=16),
    KVPolicy("fp4", "fp4", group_size=16, recent_unquantized=20, block_size=8, chunk_size=16),
    KVPolicy(
        "fp8",
        "fp8",
        group_size="tensor",
        csa_ratio=4,
        csa_window=16,
        csa_sinks=4,
        block_size=8,
        chunk_size=16,
    ),
    KVPolicy(
        "fp4",
        "fp8",
        group_size=16,
        csa_ratio=2,
        csa_window=24,
        csa_sinks=8,
        recent_unquantized=12,
        block_size=8,
        chunk_size=24,
    ),
    KVPolicy(
        "fp4",
        "fp4",
        group_size=16,
        scale_dtype="e4m3",
        k_scale_axis="channel",
        block_size=8,
        chunk_size=16,
    ),
    KVPolicy(
        "fp8",
        "fp4",
        group_size=16,
        k_scale_axis="channel",
        recent_unquantized=12,
        block_size=8,
        chunk_size=24,
    ),
    # CSA selection: a host tier, a staging pool and key bounds beside summaries (int4 keys).
    SELECTING.replace(k_dtype="int4", csa_topk=2, chunk_size=24),
    # A streamed staging pool shared by the layers, one for each of two layer formats.
    SELECTING.replace(
        layer_dtypes=("fp8/fp8", "int4/int4"), csa_topk=2, csa_staging="streamed", chunk_size=24
    ),
    # Selection without summaries: the host tier, staging pool and key bounds alone.
    SELECTING.replace(csa_summary="none", csa_topk=2, recent_unquantized=8, chunk_size=24),
    # Per-layer budgets (one layer reads none, and holds no host tier or index): the staging
    # pool follows the largest, streamed or resident.
    *(
        SELECTING.replace(csa_topk=0, layer_csa_topk=(0, 3), csa_staging=staging, chunk_size=24)
        for staging in ("streamed", "resident")
    ),
    # Selection beside rotated per-channel int4 keys, with the key bounds or the mean keys (an
    # index pool without a V half) in an int4 index.
    *(
        SELECTING.replace(
            k_dtype="int4",
            v_dtype="int4",
            k_scale_axis="channel",
            csa_summary="none",
            csa_topk=2,
            csa_index=index,
            csa_index_dtype="int4",
            rotation="hadamard",
            chunk_size=24,
        )
        for index in ("bounds", "means")
    ),
    # Importance-kept blocks beside summaries, demoted from a recent region first.
    KVPolicy(
        "fp8",
        "fp8",
        group_size=16,
        csa_ratio=4,
        csa_window=64,
        csa_sinks=4,
        csa_keep=0.25,
        recent_unquantized=8,
        block_size=8,
        chunk_size=24,
    ),
]


@pytest.mark.parametrize("policy", POLICIES_FOR_BYTES)
def test_held_bytes_equal_planner_bytes_after_every_step(tiny_llama, policy):
    llm = LLM(str(tiny_llama), policy=policy, max_model_len=160, max_num_seqs=3)
    engine = llm.engine
    # The pool tensors are the plan's pools (tests/runtime/test_pool_plan.py checks more).
    assert engine.cache.allocated_bytes == engine.pools.device_bytes
    for i, n in enumerate((37, 61, 5)):
        engine.add_request(random_tokens(n, seed=i), max_new_tokens=20)
    checked = 0
    while engine.scheduler.has_work:
        engine.step()
        for seq in engine.scheduler.running:
            kv = engine.scheduler.kv[seq.seq_id]
            held = engine._held_bytes(kv)
            assert held == kv_bytes_per_sequence(llm.arch, policy, seq.num_cached)
            host_blocks = engine.blocks.pools[HOST].num_blocks
            host_block = engine.cache.host_allocated_bytes // host_blocks if host_blocks else 0
            host = engine.blocks.held(kv)[HOST] * host_block
            assert host == host_kv_bytes_per_sequence(llm.arch, policy, seq.num_cached)
            checked += 1
    assert checked > 20
    stats = engine.stats()
    assert stats["kv_in_use_bytes"] == 0 and stats["kv_allocated_bytes"] > 0


def test_batched_and_preempted_generation_equals_one_at_a_time(tiny_llama):
    prompts = [random_tokens(n, seed=n) for n in (40, 50, 35, 60)]
    alone = LLM(str(tiny_llama), policy=AUTO_CHUNKED, max_model_len=128, max_num_seqs=1)
    expected = [alone.generate([p], max_new_tokens=30)[0].token_ids for p in prompts]
    # The minimum budget (25 blocks of 8 tokens at 1 KiB a token: 2 layers x K,V x 2 heads x
    # 32 dims x 4 B) holds about two of these sequences: continuous batching with preemptions
    # and recomputation.
    tight = LLM(
        str(tiny_llama),
        policy=AUTO_CHUNKED,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_budget_bytes=25 * 8 * 1024,
    )
    results = tight.generate(prompts, max_new_tokens=30)
    assert [r.token_ids for r in results] == expected
    assert tight.stats()["preemptions"] > 0
    assert all(r.metrics["ttft_s"] is not None and r.metrics["e2e_latency_s"] > 0 for r in results)
    assert tight.stats()["peak_main_blocks"] <= 25


TRITON_POLICIES = [
    KVPolicy(
        "fp8",
        "fp4",
        group_size=16,
        csa_ratio=2,
        csa_window=16,
        csa_sinks=4,
        recent_unquantized=8,
        block_size=8,
        chunk_size=16,
    ),
    KVPolicy(
        "fp4",
        "fp4",
        group_size=16,
        scale_dtype="e4m3",
        k_scale_axis="channel",
        block_size=8,
        chunk_size=16,
    ),
    KVPolicy(
        "int4",
        "int2",
        group_size=16,
        csa_ratio=2,
        csa_window=16,
        csa_sinks=4,
        recent_unquantized=8,
        block_size=8,
        chunk_size=16,
    ),
    # CSA selection: the stream kernel reads each query's chosen blocks through its mask.
    SELECTING,
    SELECTING.replace(csa_staging="streamed"),
    # The same beside rotated per-channel int4 keys, bounds or means in an int4 index.
    *(
        SELECTING.replace(
            k_dtype="int4",
            v_dtype="int4",
            k_scale_axis="channel",
            csa_summary="none",
            csa_index=index,
            csa_index_dtype="int4",
            rotation="hadamard",
        )
        for index in ("bounds", "means")
    ),
]


@pytest.mark.parametrize("policy", TRITON_POLICIES)
def test_triton_backend_agrees_with_torch(tiny_llama, policy):
    tokens = random_tokens(40, seed=3)
    reference = LLM(str(tiny_llama), policy=policy, max_model_len=64).prompt_logits(tokens)
    triton = LLM(str(tiny_llama), policy=policy, backend="triton", max_model_len=64)
    assert relative_error(triton.prompt_logits(tokens), reference) < 1e-4
    # The whole prompt: selecting policies then hold older blocks, which decode scores.
    torch_gen = LLM(str(tiny_llama), policy=policy, max_model_len=64).generate([tokens], 6)
    assert triton.generate([tokens], 6)[0].token_ids == torch_gen[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": {"k_dtype": "int5"}}, "policy.k_dtype"),
        ({"policy": {"k_dtype": "fp8", "group_size": 12}}, "policy.group_size"),
        ({"backend": "cuda-graphs"}, "backend"),
        ({"kv_budget_bytes": 1000}, "kv_budget_bytes"),
        ({"dtype": "int8"}, "dtype"),
        ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),
    ],
)
def test_bad_settings_fail_before_weights_load(tiny_llama, monkeypatch, kwargs, field):
    from kvtune.runtime.model import DecoderModel

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before validation")

    monkeypatch.setattr(DecoderModel, "from_checkpoint", refuse)
    with pytest.raises(ConfigError) as error:
        LLM(str(tiny_llama), **{"max_model_len": 128, **kwargs})
    assert error.value.field == field


def test_with_policy_equals_a_fresh_runtime_under_that_policy(tiny_llama):
    ids = random.Random(5).choices(range(3, TINY_VOCAB), k=70)
    exact = LLM(str(tiny_llama), KVPolicy("auto", "auto", block_size=16, chunk_size=32))
    policy = KVPolicy(
        "fp4",
        "fp8",
        group_size=8,
        block_size=16,
        chunk_size=32,
        csa_ratio=2,
        csa_window=16,
        csa_sinks=4,
    )
    fresh = LLM(str(tiny_llama), policy).prompt_logits(ids)
    switched = exact.with_policy(policy)
    assert switched.model is exact.model and switched.policy == policy
    torch.testing.assert_close(switched.prompt_logits(ids), fresh, rtol=0, atol=0)
    assert not torch.equal(exact.prompt_logits(ids), fresh)  # the original keeps its own cache
    with pytest.raises(ConfigError, match="group_size"):
        exact.with_policy(KVPolicy("fp8", "fp8", group_size=48))


def test_unknown_model_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="model"):
        LLM("no-such-model")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):
        LLM(str(tmp_path))


def test_prompt_longer_than_max_model_len_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama), policy=AUTO_CHUNKED, max_model_len=32)
    with pytest.raises(ConfigError, match="max_model_len=32"):
        llm.generate([random_tokens(33)], max_new_tokens=1)
