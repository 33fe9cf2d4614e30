"""multikey: several key -> value needles in Wikipedia prose, each question asks one key.

RULER's niah_multikey form: "One of the special magic numbers for <key> is: <7 digits>." The
other needles are distractors of the same form, so the model must bind the right key.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks.common import (
    QA,
    Conversation,
    GenContext,
    Question,
    TaskDef,
    qa_rows,
    random_digits,
    spread_depth,
)

MIN_NEEDLES = 4
ADJECTIVES = (
    "silver",
    "amber",
    "quiet",
    "brave",
    "crooked",
    "gentle",
    "hollow",
    "frozen",
    "golden",
    "hidden",
    "lucky",
    "narrow",
    "rapid",
    "rustic",
    "scarlet",
    "sleepy",
    "tender",
    "velvet",
    "wicked",
    "young",
)
NOUNS = (
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "orchid",
    "pepper",
    "walnut",
    "glacier",
    "candle",
    "river",
    "tiger",
    "violin",
    "compass",
    "kettle",
    "ladder",
    "mirror",
    "pebble",
    "saddle",
    "thistle",
    "tunnel",
)


def draw(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    """Needles at random depths."""
    return draw_at(context, size, lambda count: [context.rng.random() for _ in range(count)])


def draw_spread(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    """Needles at depths that tile the haystack over the task's documents (spread_depth), in a
    random order (the first question is not always the shallowest needle)."""

    def depths(count: int) -> list[float]:
        spread = [spread_depth(doc, size.docs, i, count) for i in range(count)]
        return context.rng.sample(spread, count)

    return draw_at(context, size, depths)


def draw_at(
    context: GenContext, size: TaskSize, depths_of: Callable[[int], list[float]]
) -> Conversation:
    """One conversation; depths_of(needles) gives the needles' depths."""
    rng = context.rng
    count = max(MIN_NEEDLES, size.questions)
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], count)
    keys = [f"{adjective}-{noun}" for adjective, noun in pairs]
    values = [random_digits(rng, 7) for _ in keys]
    depths = depths_of(count)
    questions = tuple(
        Question(
            f"What is the special magic number for {key}? Answer with the 7-digit number only.",
            f"The special magic number for {key} is ",
            value,
            depth,
        )
        for key, value, depth in list(zip(keys, values, depths, strict=True))[: size.questions]
    )
    needles = [
        (depth, f"One of the special magic numbers for {key} is: {value}.")
        for key, value, depth in zip(keys, values, depths, strict=True)
    ]
    document = context.prose_haystack(questions[0], needles, avoid=values)
    return Conversation(document, questions)


TASK = TaskDef(
    name="multikey",
    kind=QA,
    chance=1 / 9_000_000,
    max_questions=len(ADJECTIVES) * len(NOUNS),
    build=lambda context, size: qa_rows(context, size, draw),
)
