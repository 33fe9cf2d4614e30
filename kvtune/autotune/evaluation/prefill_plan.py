"""Which prompts to prefill, and in which batches, to score many requests.

Causal logits at a position depend only on the tokens up to it, so a request whose tokens are
a prefix of another's reads the longer prompt's logits instead of running its own pass. The
suite relies on it: every question of a conversation extends the previous turn's prompt, so a
conversation costs one prefill pass however many questions it asks.

A batch of such passes is one runtime call, and the unit an evaluation stores as it finishes
(unit_cache.py): its numbers depend on its own prompts only (prompts sharing a call share its
steps and chunk boundaries), never on what ran before it, so it can be stored and skipped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


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


@dataclass(frozen=True)
class PrefillUnit:
    """One runtime call: `hosts` (input indices) are prefilled together; served[i] lists the
    inputs read from hosts[i]'s pass (the host itself among them)."""

    hosts: list[int]
    served: list[list[int]]

    @property
    def members(self) -> list[int]:
        """Every input the call answers, host by host."""
        return [index for indices in self.served for index in indices]


def prefill_units(inputs: Sequence[Sequence[int]], max_tokens: int) -> list[PrefillUnit]:
    """The runtime calls that answer every input: hosts (share_prefixes) in order of first
    appearance, grouped by token_batches of their lengths."""
    serving = share_prefixes(inputs)
    hosts = list(dict.fromkeys(serving))
    served: dict[int, list[int]] = defaultdict(list)
    for index, host in enumerate(serving):
        served[host].append(index)
    return [
        PrefillUnit([hosts[b] for b in batch], [served[hosts[b]] for b in batch])
        for batch in token_batches([len(inputs[h]) for h in hosts], max_tokens)
    ]
