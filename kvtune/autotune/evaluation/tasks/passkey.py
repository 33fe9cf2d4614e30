"""passkey: a 5-digit key hidden once in Wikipedia prose; the model is asked for it.

The i-th of n documents hides its key at depth (i + 0.5) / n, so depths spread evenly over the
suite. Through the chat template SmolLM2 finds the key 12 times in 12 (DESIGN.md section 7).
"""

from __future__ import annotations

from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks.common import (
    QA,
    Conversation,
    GenContext,
    Question,
    TaskDef,
    qa_rows,
    random_digits,
)

QUESTION = "What is the pass key? Answer with the 5-digit number only."


def draw(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    depth = (doc + 0.5) / size.docs
    key = random_digits(context.rng, 5)
    question = Question(QUESTION, "The pass key is ", key, depth)
    needle = f"The pass key is {key}. Remember it."
    document = context.prose_haystack(question, [(depth, needle)], avoid=[key])
    return Conversation(document, (question,))


TASK = TaskDef(
    name="passkey",
    kind=QA,
    chance=1 / 90_000,
    max_questions=1,
    build=lambda context, size: qa_rows(context, size, draw),
)
