"""Accuracy of KV policies: a generated long-context suite run through lm-eval on the kvtune
runtime, scored against the uncompressed baseline (`evaluate`), and the `kvtune` lm-eval model.
"""

from autotune.evaluation import offline  # noqa: F401  (first: HF offline before lm-eval loads)
from autotune.evaluation.evaluator import evaluate
from autotune.evaluation.lm_backend import KVTuneLM
from autotune.evaluation.suite import EvalSuite, TaskSize, load_suite

__all__ = ["EvalSuite", "KVTuneLM", "TaskSize", "evaluate", "load_suite"]
