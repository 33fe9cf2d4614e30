"""The suite's task generators, by name (one module a probability-scored task; the greedy
generation tasks together in greedy.py)."""

from kvtune.autotune.evaluation.tasks import codes, doc_mcq, greedy, multikey, passkey, wiki_ppl
from kvtune.autotune.evaluation.tasks.common import GENERATION, PERPLEXITY, QA, GenContext, TaskDef

TASKS: dict[str, TaskDef] = {
    task.name: task
    for task in (
        *(module.TASK for module in (wiki_ppl, passkey, multikey, codes, doc_mcq)),
        *greedy.TASKS,
    )
}

__all__ = ["GENERATION", "PERPLEXITY", "QA", "TASKS", "GenContext", "TaskDef"]
