"""The greedy generation tasks: what a user sees, the model writing the answer itself through the
policy's cache, scored by exact match (lm-eval's `generate_until`).

The probability-scored tasks tell how much of the gold answer's probability a policy keeps;
these ask whether greedy decoding writes the exact digits. Each haystack carries several
questions, one chat turn each (earlier turns carry their gold answers), with their needles at
depths that tile the haystack over the task's documents:

- passkey_greedy: 5-digit pass keys, one per coloured door, each asked once.
- multikey_greedy: RULER's key -> 7-digit value needles (multikey's form), each asked once.
- codes_greedy: the 7-digit order numbers of customer-service chats (codes' transcripts).

A turn's prompt is a token prefix of the next turn's, so the questions of one haystack share
its prefill (lm_backend.py, shared_generation.py). Their exact match is reported beside
accuracy_retention, not inside it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks import codes, multikey
from kvtune.autotune.evaluation.tasks.common import (
    GENERATION,
    Conversation,
    GenContext,
    Question,
    TaskDef,
    qa_rows,
    random_digits,
    spread_depth,
)

# Tokens the model may write: a 7-digit answer is 7 tokens in SmolLM2 and Qwen2 (digits one a
# token), with a leading space and a stop after it.
MAX_GEN_TOKENS = 10
# Generation is cut at the first of these; the answer is compared with punctuation and outer
# whitespace removed (task_files.GENERATION_METRICS).
STOP = ["\n", ".", "<|im_end|>"]

DOORS = (
    "red",
    "blue",
    "green",
    "yellow",
    "orange",
    "purple",
    "white",
    "black",
    "grey",
    "brown",
    "pink",
    "silver",
    "golden",
    "violet",
    "crimson",
    "teal",
)


def draw_passkeys(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    """size.questions doors, each with its own pass key at its own depth."""
    rng = context.rng
    doors = rng.sample(DOORS, size.questions)
    keys = [random_digits(rng, 5) for _ in doors]
    spread = [spread_depth(doc, size.docs, i, size.questions) for i in range(size.questions)]
    depths = rng.sample(spread, size.questions)
    questions = tuple(
        Question(
            f"What is the pass key of the {door} door? Answer with the 5-digit number only.",
            f"The pass key of the {door} door is ",
            key,
            depth,
        )
        for door, key, depth in zip(doors, keys, depths, strict=True)
    )
    needles = [
        (depth, f"The pass key of the {door} door is {key}. Remember it.")
        for door, key, depth in zip(doors, keys, depths, strict=True)
    ]
    document = context.prose_haystack(questions[0], needles, avoid=keys)
    return Conversation(document, questions)


Draw = Callable[[GenContext, int, TaskSize], Conversation]


def _generated(name: str, chance: float, max_questions: int, draw: Draw) -> TaskDef:
    return TaskDef(
        name=name,
        kind=GENERATION,
        chance=chance,
        max_questions=max_questions,
        build=lambda context, size: qa_rows(context, size, draw, generated=True),
    )


TASKS = (
    _generated("passkey_greedy", 1 / 90_000, len(DOORS), draw_passkeys),
    _generated("multikey_greedy", 1 / 9_000_000, multikey.TASK.max_questions, multikey.draw_spread),
    _generated("codes_greedy", 1 / 9_000_000, codes.TASK.max_questions, codes.draw_orders),
)
