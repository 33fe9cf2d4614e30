"""Which prompts to prefill, and in which batches, to score many requests.

Causal logits at a position depend only on the tokens up to it, so a request whose tokens are
a prefix of another's reads the longer prompt's logits instead of running its own pass. The
suite relies on it: every question of a conversation extends the previous turn's prompt, so a
conversation costs one prefill pass however many questions it asks.
"""

from __future__ import annotations

from collections.abc import Sequence


def share_prefixes(inputs: Sequence[Sequence[int]]) -> list[int]:
    """For each input, the index of the input whose pass serves it: itself, or a longer (or
    equal, earlier) input that starts with it."""
    order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i]), i))
    hosts: list[int] = []
    serving = [0] * len(inputs)
    for index in order:
        tokens = list(inputs[index])
        host = next(
            (h for h in hosts if list(inputs[h][: len(tokens)]) == tokens),
            None,
        )
        if host is None:
            hosts.append(index)
            host = index
        serving[index] = host
    return serving


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups of indices whose lengths sum to at most max_tokens (a longer one
    alone), bounding the logits a runtime call returns at once."""
    batches: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if batches and used + length <= max_tokens:
            batches[-1].append(index)
            used += length
        else:
            batches.append([index])
            used = length
    return batches
