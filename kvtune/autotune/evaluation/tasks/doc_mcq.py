"""doc_mcq: "What is <title>?" with four descriptions, the answer's paragraph buried in prose.

The four descriptions are the opening sentences of four Wikipedia articles whose paragraphs are
all buried in the document, so the model must bind the asked title to its own paragraph. The
model answers by starting the matching description ("<title> is a ..."), and its first three
words are scored (their probability, and exact greedy match). Two forms were dropped for
SmolLM2-135M: answering with the option letter scores at chance (25%), and lm-eval's
multiple_choice (one log-likelihood a description) costs four prefill passes a question
without a prefix cache in the runtime.
"""

from __future__ import annotations

from functools import cache

from kvtune.autotune.evaluation import haystack
from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks.common import (
    QA,
    Conversation,
    GenContext,
    Question,
    TaskDef,
    qa_rows,
)

OPTIONS = 4
ANSWER_WORDS = 3
MIN_DESCRIPTION, MAX_DESCRIPTION = 30, 200  # characters


@cache
def described() -> tuple[tuple[haystack.Paragraph, str, str], ...]:
    """(paragraph, verb, description) of paragraphs opening "<title> is|was a <description>."."""
    found = []
    for paragraph in haystack.haystack_paragraphs():
        first = haystack.SENTENCE_END.split(paragraph.text)[0]
        for verb in ("is", "was"):
            opening = f"{paragraph.title} {verb} a "
            if first.startswith(opening):
                description = first[len(opening) - 2 :]
                if MIN_DESCRIPTION <= len(description) <= MAX_DESCRIPTION:
                    found.append((paragraph, verb, description))
    return tuple(found)


def answer_words(description: str) -> str:
    """The words after the article that the model must produce."""
    return " ".join(description.split()[1 : 1 + ANSWER_WORDS])


def draw(context: GenContext, doc: int, size: TaskSize) -> Conversation:
    rng = context.rng
    buried = rng.sample(described(), max(OPTIONS, size.questions))
    depths = [rng.random() for _ in buried]
    descriptions = [description for _, _, description in buried]
    questions = []
    for (paragraph, verb, description), depth in list(zip(buried, depths, strict=True))[
        : size.questions
    ]:
        others = rng.sample([d for d in descriptions if d != description], OPTIONS - 1)
        listed = "\n".join(f"- {option}" for option in rng.sample([description, *others], OPTIONS))
        questions.append(
            Question(
                f"What is {paragraph.title}?\n{listed}\nAnswer with the matching description.",
                f"{paragraph.title} {verb} a ",
                answer_words(description),
                depth,
            )
        )
    needles = [
        (depth, paragraph.text) for (paragraph, _, _), depth in zip(buried, depths, strict=True)
    ]
    avoid = [p.title for p, _, _ in buried] + [answer_words(d) for d in descriptions]
    document = context.prose_haystack(questions[0], needles, avoid)
    return Conversation(document, tuple(questions))


TASK = TaskDef(
    name="doc_mcq",
    kind=QA,
    chance=1 / OPTIONS,
    max_questions=64,
    build=lambda context, size: qa_rows(context, size, draw),
)
