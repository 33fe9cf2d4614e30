"""The suite's task generators, by name (one module a task)."""

from kvtune.autotune.evaluation.tasks import (
    codes,
    doc_mcq,
    multikey,
    needle_greedy,
    passkey,
    wiki_ppl,
)
from kvtune.autotune.evaluation.tasks.common import GENERATION, PERPLEXITY, QA, GenContext, TaskDef

TASKS: dict[str, TaskDef] = {
    module.TASK.name: module.TASK
    for module in (wiki_ppl, passkey, multikey, codes, doc_mcq, needle_greedy)
}

__all__ = ["GENERATION", "PERPLEXITY", "QA", "TASKS", "GenContext", "TaskDef"]
