"""Greedy turns of one haystack share its prefill: the same answers as one generation per prompt
(SmolLM2 through an unquantized cache), for far fewer prefilled tokens; and a quantized cache
reads no later token of a prefill chunk (its logits move only by fp32 rounding, amplified)."""

from __future__ import annotations

import random

import pytest
import torch

import kvtune.autotune.evaluation  # noqa: F401  (HF offline variables)
from kvtune.autotune.evaluation import haystack
from kvtune.autotune.evaluation.shared_generation import cut_at_stops, greedy_generate
from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks import TASKS, GenContext
from kvtune.autotune.evaluation.tasks.greedy import MAX_GEN_TOKENS, STOP
from kvtune.runtime.llm import LLM

AUTO = {"k_dtype": "auto", "v_dtype": "auto"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", policy=AUTO, max_num_seqs=4, max_model_len=2048)


@pytest.fixture(scope="module")
def conversation(llm) -> tuple[list[list[int]], list[str]]:
    """Three pass-key turns on one 400-token haystack, as the suite renders them, and their
    gold answers."""
    context = GenContext(random.Random("shared"), llm.tokenizer, 400)
    rows = TASKS["passkey_greedy"].rows(context, TaskSize(docs=1, questions=3))
    return [llm.tokenizer.encode(row["context"]) for row in rows], [row["answer"] for row in rows]


def texts(llm: LLM, token_ids: list[list[int]]) -> list[str]:
    return [cut_at_stops(llm.tokenizer.decode(ids), STOP) for ids in token_ids]


@pytest.fixture(scope="module")
def alone(llm, conversation) -> list[str]:
    """The reference: each turn prefilled and decoded on its own by the engine."""
    prompts, _ = conversation
    return [texts(llm, [llm.generate([p], MAX_GEN_TOKENS)[0].token_ids])[0] for p in prompts]


def test_turns_share_one_prefill_and_answer_as_alone(llm, conversation, alone):
    prompts, golds = conversation
    shared = greedy_generate(llm, prompts, MAX_GEN_TOKENS, STOP)
    assert texts(llm, shared.token_ids) == alone
    # An earlier turn answered right follows the last turn's prefill to its stop; one answered
    # wrong leaves the gold answer the last turn carries and is finished on its own (the last
    # turn generates for itself, right or wrong).
    earlier = zip(alone[:-1], golds[:-1], strict=True)
    wrong = sum(text.strip() != gold for text, gold in earlier)
    assert shared.own_generations == wrong
    assert shared.unshared_tokens == sum(len(p) for p in prompts)
    if not wrong:
        assert shared.prefilled_tokens == len(prompts[-1])


def test_a_turn_whose_answer_leaves_the_host_is_generated_on_its_own(llm, conversation, alone):
    """The host carries a wrong answer after the first turn, so greedy decoding of that turn
    leaves the host's tokens at the key's first digit and must finish on its own."""
    first = conversation[0][0]
    wrong = llm.tokenizer.encode(" 00000. The pass key", add_special_tokens=False)
    shared = greedy_generate(llm, [first, first + wrong], MAX_GEN_TOKENS, STOP)
    assert alone[0].strip().isdigit() and alone[0].strip() != "00000"
    assert texts(llm, shared.token_ids)[0] == alone[0]
    assert shared.own_generations == 1
    assert shared.prefilled_tokens > len(first + wrong)


def prompt_ids(llm: LLM, tokens: int) -> list[int]:
    paragraphs = haystack.fill(
        random.Random(0),
        haystack.haystack_paragraphs(),
        tokens + 100,
        lambda text: len(llm.tokenizer.encode(text, add_special_tokens=False)),
    )
    return llm.tokenizer.encode("\n\n".join(paragraphs))[:tokens]


def prefix_logits_alone_and_inside(llm: LLM, policy: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of positions 520..559 from a 560-token prompt, and from a 640-token prompt that
    starts with it (chunks of 512: positions 512..559 share a chunk with 560..639)."""
    quantized = llm.with_policy(policy)
    ids = prompt_ids(llm, 640)
    inside = quantized.prompt_logits_batch([ids], [520])[0][:40]
    by_itself = quantized.prompt_logits_batch([ids[:560]], [520])[0]
    return by_itself, inside


def test_an_unquantized_prefix_reads_the_same_logits_inside_a_longer_prompt(llm):
    by_itself, inside = prefix_logits_alone_and_inside(llm, AUTO)
    torch.testing.assert_close(by_itself, inside, rtol=0, atol=1e-3)


def first_layer_outputs(llm: LLM, ids: list[int], positions: slice) -> torch.Tensor:
    """Layer 0's attention output at `positions` (the cache read before any layer could
    amplify fp32 rounding), from a prefill of `ids`."""
    outputs: list[torch.Tensor] = []
    cache = llm.engine.cache
    attend = cache.attend

    def recording(layer, layout, q, k, v, scale):
        out = attend(layer, layout, q, k, v, scale)
        if layer == 0:
            outputs.append(out.detach().clone())
        return out

    cache.attend = recording
    try:
        llm.prompt_logits(ids)
    finally:
        del cache.attend
    return torch.cat(outputs)[positions]


def test_a_quantized_prefix_reads_the_same_cache_inside_a_longer_prompt(llm):
    """With int4 codes, positions 520..559 read the same cache whether 80 more tokens share
    their chunk or not: layer 0's attention agrees to fp32 rounding (a block quantized early,
    or any read of a later token, would move it by about 1e-2). Their logits still differ:
    fp32 sums over 560 and 640 rows round apart by about 1e-7, a value on a code boundary
    flips code, and 30 layers amplify the flips. That is the cache's sensitivity, not a read of
    later tokens: the same size of perturbation at equal shapes moves the logits as much
    (benchmarks/chunk_dependence.py). Prefix sharing gives one of the equally valid roundings."""
    quantized = llm.with_policy({"k_dtype": "int4", "v_dtype": "int4", "group_size": 32})
    ids = prompt_ids(llm, 640)
    inside = first_layer_outputs(quantized, ids, slice(520, 560))
    by_itself = first_layer_outputs(quantized, ids[:560], slice(520, 560))
    torch.testing.assert_close(by_itself, inside, rtol=1e-5, atol=1e-6)
