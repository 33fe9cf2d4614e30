"""Greedy generation for many prompts that extend one another, with one prefill per conversation.

The greedy tasks ask several questions about one haystack, one chat turn each; a turn's prompt
is a token prefix of the next turn's, which carries the earlier gold answers. Greedy decoding
from a prompt P writes, token by token, the argmax of the logits at P's end, then at the next
position, ...: while those argmaxes equal the tokens that follow P inside a longer prompt, they
are the longer prompt's own prompt logits (causal attention: a position sees only the tokens
before it). So each conversation is prefilled once, its last turn (the host) generating for
itself, and every earlier turn follows the host's logits from its own end. Where its greedy
token leaves the host's tokens before a stop is written, the turn is generated on its own from
there (prompt + the tokens followed so far), so the text is always what greedy decoding of the
turn alone writes.

No position reads a later token of its chunk, so this is exact up to rounding: a quantized
cache's logits move with the last bits of the chunk's fp32 sums (a code on a boundary flips,
the layers amplify it), so a shared turn reads one of the equally likely roundings of its own
prefill (tests/autotune/test_shared_generation.py, benchmarks/chunk_dependence.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtune.autotune.evaluation.prefill_plan import share_prefixes
from kvtune.runtime.llm import LLM

logger = logging.getLogger(__name__)


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """text up to the first occurrence of any stop string (lm-eval's `until`)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


@dataclass(frozen=True)
class SharedGeneration:
    """Generated token ids per prompt, and what the prefills cost.

    prefilled_tokens: prompt tokens prefilled (hosts and turns generated on their own).
    unshared_tokens: prompt tokens one prefill per prompt would have taken.
    own_generations: turns that left their host's tokens and were generated on their own.
    """

    token_ids: list[list[int]]
    prefilled_tokens: int
    unshared_tokens: int
    own_generations: int


def greedy_generate(
    llm: LLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, until: Sequence[str]
) -> SharedGeneration:
    """Greedy continuations of every prompt (stopping at EOS or max_new_tokens as the engine
    does, or earlier once a stop string of `until` is written: the text cut there is final)."""
    prompts = [list(p) for p in prompts]
    serving = share_prefixes(prompts)
    served: dict[int, list[int]] = defaultdict(list)
    for index, host in enumerate(serving):
        served[host].append(index)
    stop_ids = frozenset(llm.tokenizer.eos_token_ids)
    engine = llm.engine
    hosts = {}
    for host, indices in served.items():
        first = min(len(prompts[i]) for i in indices) - 1
        hosts[host] = engine.add_request(prompts[host], max_new_tokens, 0.0, stop_ids, first), first
    engine.run()
    results: list[list[int]] = [[] for _ in prompts]
    left: dict[int, list[int]] = {}  # served prompts that left their host: tokens so far
    for host, (seq, first) in hosts.items():
        follower = _Follower(
            llm, prompts[host], engine.take_prompt_logits(seq), first, max_new_tokens, until
        )
        for index in served[host]:
            if len(prompts[index]) == len(prompts[host]):
                results[index] = list(seq.output_ids)
                continue
            tokens, complete = follower.follow(len(prompts[index]) - 1, stop_ids)
            if complete:
                results[index] = tokens
            else:
                left[index] = tokens
    alone = {
        index: engine.add_request(
            prompts[index] + tokens, max_new_tokens - len(tokens), 0.0, stop_ids
        )
        for index, tokens in left.items()
    }
    engine.run()
    for index, seq in alone.items():
        results[index] = left[index] + list(seq.output_ids)
    shared = SharedGeneration(
        results,
        sum(len(prompts[h]) for h in hosts) + sum(len(seq.prompt_ids) for seq in alone.values()),
        sum(len(p) for p in prompts),
        len(alone),
    )
    logger.info(
        "greedy generation: %d prompts, %d prefilled tokens of %d (%d generated on their own)",
        len(prompts),
        shared.prefilled_tokens,
        shared.unshared_tokens,
        shared.own_generations,
    )
    return shared


@dataclass(frozen=True)
class _Follower:
    """Greedy decoding read from a host's prompt logits (rows from position `first` on)."""

    llm: LLM
    host: list[int]
    logits: torch.Tensor
    first: int
    max_new_tokens: int
    until: Sequence[str]

    def follow(self, position: int, stop_ids: frozenset[int]) -> tuple[list[int], bool]:
        """(greedy tokens after the prompt ending at `position`, whether they are complete);
        incomplete where the next token's logits are not the host's."""
        tokens: list[int] = []
        while True:
            token = int(torch.argmax(self.logits[position - self.first]))
            tokens.append(token)
            text = self.llm.tokenizer.decode(tokens)
            if (
                token in stop_ids
                or len(tokens) == self.max_new_tokens
                or any(stop and stop in text for stop in self.until)
            ):
                return tokens, True
            position += 1
            if position >= len(self.host) or self.host[position] != token:
                return tokens, False
