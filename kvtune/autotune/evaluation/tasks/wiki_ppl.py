"""wiki_ppl: perplexity over held-out Wikipedia lead paragraphs, one document per sample.

Each document joins held-out paragraphs (never in a haystack) up to about context_tokens, so
the later tokens are predicted through a cache as long as the other tasks' prompts.
"""

from __future__ import annotations

from typing import Any

from kvtune.autotune.evaluation import haystack
from kvtune.autotune.evaluation.suite import TaskSize
from kvtune.autotune.evaluation.tasks.common import PERPLEXITY, GenContext, TaskDef


def build(context: GenContext, size: TaskSize) -> list[dict[str, Any]]:
    pool = haystack.held_out_paragraphs()
    rows = []
    for doc in range(size.docs):
        paragraphs = haystack.fill(context.rng, pool, context.context_tokens, context.count)
        rows.append({"text": "\n\n".join(paragraphs), "doc": doc})
    return rows


TASK = TaskDef(name="wiki_ppl", kind=PERPLEXITY, chance=None, max_questions=1, build=build)
