"""What every task generator shares: questions, conversations, the chat rendering, haystacks.

A question-answering task is a list of conversations: a document (haystack) and questions
about it, one user turn each. The assistant's turn opens with an answer prefix that echoes the
needle's wording (RULER style), and the gold answer is scored by the probability the model
gives it, and by exact greedy match (scoring.py): the embedded 135M model answers short
factual questions through its chat template but fumbles free-form openings (the shared
DESIGN.md, section 7). Later turns carry the earlier gold answers, so every
question of a conversation extends the same prompt and shares one prefill pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.autotune.evaluation import haystack
from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.tokenizer import Tokenizer

QA = "qa"  # lm-eval `loglikelihood` of a short gold answer (its probability, greedy match)
PERPLEXITY = "perplexity"  # lm-eval `loglikelihood_rolling`
GENERATION = "generation"  # lm-eval `generate_until`, greedy, scored by exact match
MAX_DRAWS = 100


@dataclass(frozen=True)
class Question:
    """One question about a document.

    user: the user's turn (the first turn also carries the document).
    answer_prefix: opening of the assistant's reply, echoing the needle's wording.
    answer: the gold continuation, present exactly once in the document.
    depth: where the answer sits in the document (0 = start, 1 = end), when it is placed.
    """

    user: str
    answer_prefix: str
    answer: str
    depth: float | None = None


@dataclass(frozen=True)
class Conversation:
    document: str
    questions: tuple[Question, ...]


@dataclass(frozen=True)
class GenContext:
    """What a generator draws from: its own seeded rng, the model's tokenizer, the length."""

    rng: random.Random
    tokenizer: Tokenizer
    context_tokens: int

    def count(self, text: str) -> int:
        """Tokens of text inside a prompt (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def document_budget(self, first_question: Question, needles: Sequence[str] = ()) -> int:
        """Tokens left for filler so that the first prompt is about context_tokens long."""
        frame = render(Conversation("", (first_question,)), self.tokenizer)[0]["context"]
        return self.context_tokens - self.count(frame) - sum(self.count(n) for n in needles)

    def prose_haystack(
        self, first_question: Question, needles: Sequence[tuple[float, str]], avoid: Sequence[str]
    ) -> str:
        """Wikipedia paragraphs with needles at their depths, sized to context_tokens."""
        budget = self.document_budget(first_question, [text for _, text in needles])
        paragraphs = haystack.fill(
            self.rng, haystack.haystack_paragraphs(), budget, self.count, avoid
        )
        return "\n\n".join(haystack.insert(paragraphs, needles))


@dataclass(frozen=True)
class TaskDef:
    """A task generator and how it is scored.

    kind: QA, PERPLEXITY or GENERATION. chance: the score of guessing (QA: exact-match of a random
    answer; None for perplexity). max_questions: questions a document can carry.
    build: (context, size) -> JSONL rows of the lm-eval task.
    """

    name: str
    kind: str
    chance: float | None
    max_questions: int
    build: Callable[[GenContext, TaskSize], list[dict[str, Any]]]

    def rows(self, context: GenContext, size: TaskSize) -> list[dict[str, Any]]:
        if size.questions > self.max_questions:
            raise ConfigError(
                f"eval.tasks.{self.name}.questions",
                size.questions,
                f"at most {self.max_questions} for this task",
            )
        return self.build(context, size)


def render(
    conversation: Conversation, tokenizer: Tokenizer, generated: bool = False
) -> list[dict[str, Any]]:
    """One row per question: the chat prompt up to the answer, and the answer.

    generated: the answer is generated, so the prompt stops before the answer prefix's trailing
    whitespace (the model writes it with the answer's first token, as a tokenizer that joins a
    space to the following digits spells it); then each turn's prompt is a token prefix of the
    next turn's, which carries the earlier gold answers, and their prefill can be shared.
    """
    messages: list[dict[str, str]] = []
    rows = []
    for turn, question in enumerate(conversation.questions):
        content = f"{conversation.document}\n\n{question.user}" if turn == 0 else question.user
        messages.append({"role": "user", "content": content})
        prefix = question.answer_prefix.rstrip() if generated else question.answer_prefix
        context = tokenizer.apply_chat_template(messages) + prefix
        rows.append(
            {"context": context, "answer": question.answer, "turn": turn, "depth": question.depth}
        )
        messages.append({"role": "assistant", "content": question.answer_prefix + question.answer})
    return rows


def qa_rows(
    context: GenContext,
    size: TaskSize,
    draw: Callable[[GenContext, int, TaskSize], Conversation],
    generated: bool = False,
) -> list[dict[str, Any]]:
    """Rows of size.docs conversations; draw(context, doc index, size) makes one (rendered for
    generated answers with `generated`).

    A draw whose answers do not each appear exactly once in its document is redrawn (the
    rng moves on, so the result stays deterministic).
    """
    rows = []
    for doc in range(size.docs):
        for _ in range(MAX_DRAWS):
            conversation = draw(context, doc, size)
            if all(conversation.document.count(q.answer) == 1 for q in conversation.questions):
                break
        else:
            raise RuntimeError(f"no document with each answer exactly once in {MAX_DRAWS} draws")
        rendered = render(conversation, context.tokenizer, generated)
        rows += [{**row, "doc": doc} for row in rendered]
    return rows


def spread_depth(doc: int, docs: int, needle: int, needles: int) -> float:
    """Depth of one of `needles` needles in document `doc` of `docs`: the docs x needles needles
    of a task tile [0, 1] evenly (each document's own spread over it, offset per document), so
    every stretch of the haystack holds some whatever the sizes."""
    return (needle * docs + doc + 0.5) / (docs * needles)


def random_digits(rng: random.Random, digits: int) -> str:
    """A number with exactly `digits` digits (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))
