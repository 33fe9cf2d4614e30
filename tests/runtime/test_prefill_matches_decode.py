"""A position scored in prefill reads exactly the cache a decode step at that position reads.

The oracle is decode itself: the prompt fed one token a step (teacher-forced), so every
demotion out of the fp16 recent region and every CSA compression has happened before the
position's attention, as in serving. Chunked prefill must give the same logits whatever the
chunk size and whatever other prompts share its steps.

Tolerance: decode projects one token at a time, prefill a chunk (another CPU matmul path), so K
and V differ by fp32 rounding, and a value within that rounding of a code boundary lands on the
neighbouring 4-bit code. One such flip moves this tiny model's logits by about 1e-5 relative
(measured 0.4e-6 to 1.9e-5 over eight weight draws and the quantized policies here), hence 5e-5,
while each policy moves them from the exact cache's by more than 1e-3 (the guard test below).
"""

from __future__ import annotations

import pytest
import torch

from kvtune.runtime import LLM
from kvtune.runtime.policy import KVPolicy
from tests.runtime.test_engine import random_tokens, relative_error

BLOCK = 8
POLICIES = {
    "csa": KVPolicy(
        k_dtype="fp8", v_dtype="fp8", csa_ratio=4, csa_window=24, csa_sinks=4, block_size=BLOCK
    ),
    "recent_window": KVPolicy(
        k_dtype="fp4", v_dtype="fp4", group_size=16, recent_unquantized=20, block_size=BLOCK
    ),
    "quantized": KVPolicy(k_dtype="fp4", v_dtype="fp8", group_size=16, block_size=BLOCK),
    # Recent region shorter than the window: a block is demoted, then pooled from its codes.
    "csa_recent_inside_window": KVPolicy(
        k_dtype="fp4",
        v_dtype="fp4",
        group_size=16,
        csa_ratio=2,
        csa_window=32,
        csa_sinks=3,
        recent_unquantized=12,
        block_size=BLOCK,
    ),
    # Keys scaled per channel over each block: a block stays fp16 until full.
    "channel_keys": KVPolicy(
        k_dtype="fp4",
        v_dtype="fp4",
        group_size=16,
        scale_dtype="e4m3",
        k_scale_axis="channel",
        block_size=BLOCK,
    ),
    "channel_keys_recent_window": KVPolicy(
        k_dtype="fp8",
        v_dtype="fp4",
        group_size=16,
        k_scale_axis="channel",
        recent_unquantized=20,
        block_size=BLOCK,
    ),
    # Recent region longer than the window: window blocks are pooled from their fp16 copy.
    # Summaries pooled as cached: with fp4 values this case sits at the fp32 noise floor (fp4
    # codes flip where the model's matmuls round differently for 1 and 90 tokens: 9.8e-6 pooled
    # as cached, 1.06e-5 turned pre-RoPE); pre-RoPE pooling is checked by "csa" and "csa_select".
    "csa_recent_past_window": KVPolicy(
        csa_summary="post_rope",
        k_dtype="fp8",
        v_dtype="fp4",
        group_size=16,
        csa_ratio=8,
        csa_window=16,
        csa_sinks=5,
        recent_unquantized=40,
        block_size=BLOCK,
    ),
    # CSA selection: each query reads its 2 best older blocks exactly, fetched from the host
    # tier in decode, read in place by each prefill query.
    "csa_select": KVPolicy(
        k_dtype="fp8",
        v_dtype="fp8",
        csa_ratio=4,
        csa_window=16,
        csa_sinks=4,
        csa_topk=2,
        csa_host=True,
        block_size=BLOCK,
    ),
    # Selection scored on summaries pooled as cached (post-RoPE), from fp16 recent copies.
    "csa_select_post_rope_recent": KVPolicy(
        csa_index="summaries",
        k_dtype="int4",
        v_dtype="fp8",
        group_size=16,
        csa_ratio=2,
        csa_window=16,
        csa_sinks=3,
        csa_summary="post_rope",
        csa_topk=3,
        csa_host=True,
        recent_unquantized=24,
        rotation="hadamard",
        block_size=BLOCK,
    ),
    # Selection without summaries (Quest): older blocks not selected are not read at all;
    # recent copies move straight to the host tier.
    "csa_select_no_summaries": KVPolicy(
        k_dtype="int8",
        v_dtype="fp8",
        group_size=16,
        csa_ratio=2,
        csa_window=16,
        csa_sinks=4,
        csa_summary="none",
        csa_topk=2,
        csa_host=True,
        recent_unquantized=24,
        block_size=BLOCK,
    ),
    # Selection with key bounds in a separate int4 index (the model's basis) beside rotated,
    # per-channel int4 keys, each block quantized once full.
    "csa_select_channel_keys_int4_index": KVPolicy(
        k_dtype="int4",
        v_dtype="int4",
        group_size=16,
        k_scale_axis="channel",
        csa_ratio=2,
        csa_window=16,
        csa_sinks=4,
        csa_summary="none",
        csa_topk=2,
        csa_host=True,
        csa_index_dtype="int4",
        rotation="hadamard",
        block_size=BLOCK,
    ),
    # Importance-kept blocks: 4 of each group of 8 older blocks stay exact, chosen by the window
    # attention of the queries before the group's first block leaves the window.
    "csa_keep": KVPolicy(
        k_dtype="fp8",
        v_dtype="fp8",
        csa_ratio=4,
        csa_window=56,
        csa_sinks=2,
        csa_keep=0.5,
        block_size=BLOCK,
    ),
}
# Selection on mean keys in the layers' own int8 pools (auto): an index pool without a V half.
# (With fp8 values this case sits on an fp8 rounding boundary: a value of layer 1 computed for 1
# and for 90 tokens rounds to codes a step apart, 2.6e-4 at the positions that read it; the
# selections are the same.)
POLICIES["csa_select_means"] = POLICIES["csa_select_no_summaries"].replace(
    v_dtype="int8", recent_unquantized=0, csa_index="means"
)
# A choice reused for 3 positions (LServe): each query scored by the query at the latest
# multiple of 3, which chunks of 8 split from its queries; decode reuses the staged choice
# between anchors. And every 4 positions from a streamed staging pool, which refetches the
# reused choice in every layer.
POLICIES["csa_select_every_3"] = POLICIES["csa_select"].replace(csa_select_every=3)
POLICIES["csa_select_streamed_every_4"] = POLICIES["csa_select_channel_keys_int4_index"].replace(
    csa_select_every=4, csa_staging="streamed"
)
# Reuse in the first layer only: each layer keeps its own anchors and staged choices.
POLICIES["csa_select_every_3_in_layer_0"] = POLICIES["csa_select_no_summaries"].replace(
    layer_csa_select_every=(3, 1)
)
# Two-stage selection: 3 x topk shortlisted on a separate int4 index in the model's basis,
# decided by the rotated int4 host tier's keys (queries rotated for them); and with reuse, by
# the anchors' queries.
POLICIES["csa_select_rescored"] = POLICIES["csa_select_channel_keys_int4_index"].replace(
    csa_rescore=3
)
POLICIES["csa_select_rescored_every_3"] = POLICIES["csa_select_no_summaries"].replace(
    csa_rescore=2, csa_select_every=3
)
PROMPT = random_tokens(90, seed=3)
OTHERS = [random_tokens(70, seed=4), random_tokens(41, seed=5)]


def prefill_logits(folder, policy: KVPolicy, chunk_size: int, with_others: bool) -> torch.Tensor:
    """Logits of PROMPT by chunked prefill; with_others puts two more prompts in its steps."""
    llm = LLM(str(folder), policy=policy.replace(chunk_size=chunk_size), max_model_len=256)
    prompts = [PROMPT, *OTHERS] if with_others else [PROMPT]
    return llm.prompt_logits_batch(prompts)[0]


def decode_logits(folder, policy: KVPolicy) -> torch.Tensor:
    """Logits of PROMPT[:-1] by decode: the first token alone, then one forced token a step."""
    llm = LLM(str(folder), policy=policy.replace(chunk_size=BLOCK), max_model_len=256)
    seen: list[torch.Tensor] = []

    def forced_next_token(logits: torch.Tensor, temperature: float) -> int:
        seen.append(logits.float().cpu())
        return PROMPT[len(seen)]

    llm.engine._choose = forced_next_token  # teacher forcing: the prompt's own next token
    llm.engine.add_request(PROMPT[:1], max_new_tokens=len(PROMPT) - 1)
    llm.engine.run()
    return torch.stack(seen[: len(PROMPT) - 1])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefill_logits_do_not_depend_on_chunks_or_batch_and_equal_decode(tiny_llama, name):
    policy = POLICIES[name]
    reference = decode_logits(tiny_llama, policy)
    for chunk_size in (512, BLOCK):
        for with_others in (False, True):
            logits = prefill_logits(tiny_llama, policy, chunk_size, with_others)
            error = relative_error(logits[:-1], reference)
            assert error <= 5e-5, (chunk_size, with_others, error)


def test_the_policies_change_logits_where_decode_says_they_should(tiny_llama):
    """Guard against a vacuous pass: each policy's decode logits differ from the exact cache's."""
    exact = decode_logits(tiny_llama, KVPolicy("auto", "auto", block_size=BLOCK))
    for name, policy in POLICIES.items():
        assert relative_error(decode_logits(tiny_llama, policy), exact) > 1e-3, name
