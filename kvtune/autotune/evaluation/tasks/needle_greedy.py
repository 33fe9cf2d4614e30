"""needle_greedy: the pass-key needle at a long context, answered by greedy generation.

The probability-scored tasks tell how much of the gold answer's probability a policy keeps;
this one asks what a user sees: does the model, decoding greedily through the policy's cache,
write the exact key? The haystack is the passkey task's (Wikipedia prose, one 5-digit key at
depth (i + 0.5) / n), usually longer than the suite's (TaskSize.context_tokens, >= 4K in the
heldout and full presets). Each question costs a full prefill (no prefix shared between
generation requests), so it runs in the larger presets only, and its exact-match retention is
reported beside accuracy_retention, not inside it.
"""

from __future__ import annotations

from kvtune.autotune.evaluation.tasks import passkey
from kvtune.autotune.evaluation.tasks.common import GENERATION, TaskDef, qa_rows

# Tokens the model may write: SmolLM2 spells a 5-digit key as 5 tokens, then a stop.
MAX_GEN_TOKENS = 8
# Generation stops at the first of these; the key is compared with punctuation and outer
# whitespace removed.
STOP = ["\n", ".", "<|im_end|>"]

TASK = TaskDef(
    name="needle_greedy",
    kind=GENERATION,
    chance=1 / 90_000,
    max_questions=1,
    build=lambda context, size: qa_rows(context, size, passkey.draw),
)
