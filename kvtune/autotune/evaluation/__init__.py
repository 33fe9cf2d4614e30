"""Accuracy of KV policies: a generated long-context suite run through lm-eval on the kvtune
runtime, scored against the uncompressed baseline (`evaluate`), and the `kvtune` lm-eval model.
"""

from kvtune.autotune.evaluation import offline  # noqa: F401  (first: HF offline before lm-eval loads)
from kvtune.autotune.evaluation.evaluator import evaluate
from kvtune.autotune.evaluation.lm_backend import KVTuneLM
from kvtune.autotune.evaluation.suite import EvalSuite, TaskSize, load_suite

__all__ = ["EvalSuite", "KVTuneLM", "TaskSize", "evaluate", "load_suite"]
