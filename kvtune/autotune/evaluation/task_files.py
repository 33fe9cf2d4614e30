"""Write a suite's generated tasks as lm-eval YAML tasks over local JSONL files.

One folder per suite data fingerprint (model, seed, lengths, sizes) under the kvtune cache:
<task>.jsonl, <task>.yaml (`dataset_path: json`) and manifest.json. Generation is seeded, so a
folder is written once and reused by every trial; lm-eval finds the tasks through
`TaskManager(include_path=folder)`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.tasks import GENERATION, PERPLEXITY, QA, TASKS, GenContext
from kvtune.autotune.evaluation.tasks.greedy import MAX_GEN_TOKENS, STOP
from kvtune.runtime.fingerprint import code_fingerprint
from kvtune.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TASK_PREFIX = "kvtune_"
MANIFEST = "manifest.json"
# The code that writes a suite's task files: their folder is named by its fingerprint, so a
# changed generator writes new files instead of reusing old ones.
GENERATOR_CODE = (
    "kvtune.autotune.evaluation.tasks",
    "kvtune.autotune.evaluation.task_files",
    "kvtune.autotune.evaluation.haystack",
)
LM_EVAL_TASK_VERSION = 1  # lm-eval's per-task version field (reported, not a cache key)

QA_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
]
GENERATION_METRICS = [
    {
        "metric": "exact_match",
        "aggregation": "mean",
        "higher_is_better": True,
        "ignore_punctuation": True,
        "regexes_to_ignore": [r"^\s+", r"\s+$"],
    }
]
PERPLEXITY_METRICS = [
    {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
    {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
    {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
]


@dataclass(frozen=True)
class TaskFolder:
    """A written suite: where it is, its lm-eval task names and rows, its longest request.

    max_tokens: tokens of the longest request (prompt and answer, or document and its
    prefix token); the runtime's max_model_len.
    """

    path: Path
    rows: dict[str, list[dict[str, Any]]]
    max_tokens: int

    def lm_eval_name(self, task: str) -> str:
        return TASK_PREFIX + task


def task_yaml(name: str, kind: str, data_file: Path) -> dict[str, Any]:
    """The lm-eval task config of one generated task."""
    config: dict[str, Any] = {
        "task": TASK_PREFIX + name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
    }
    if kind == QA:
        # Bare column names: lm-eval returns the field as it is, no Jinja rendering.
        config |= {
            "output_type": "loglikelihood",
            "doc_to_text": "context",
            "doc_to_target": "answer",
            "target_delimiter": "",
            "metric_list": QA_METRICS,
        }
    elif kind == GENERATION:
        config |= {
            "output_type": "generate_until",
            "doc_to_text": "context",
            "doc_to_target": "answer",
            "target_delimiter": "",
            "generation_kwargs": {
                "until": STOP,
                "max_gen_toks": MAX_GEN_TOKENS,
                "do_sample": False,
                "temperature": 0.0,
            },
            "metric_list": GENERATION_METRICS,
        }
    elif kind == PERPLEXITY:
        config |= {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "text",
            "metric_list": PERPLEXITY_METRICS,
        }
    else:
        raise ValueError(kind)
    return config | {"metadata": {"version": LM_EVAL_TASK_VERSION}}


def request_tokens(kind: str, row: dict[str, Any], tokenizer: Tokenizer) -> int:
    """Tokens the runtime must hold for one request (its max_model_len share)."""
    if kind == PERPLEXITY:
        return len(tokenizer.encode(row["text"])) + 1  # the rolling window's prefix token
    if kind == GENERATION:
        return len(tokenizer.encode(row["context"])) + MAX_GEN_TOKENS
    return len(tokenizer.encode(row["context"] + row["answer"]))


def generate_rows(suite: EvalSuite, tokenizer: Tokenizer) -> dict[str, list[dict[str, Any]]]:
    """Every task's rows; each task draws from its own rng, so sizes of one leave the rest."""
    rows = {}
    for name, size in suite.tasks.items():
        rng = random.Random(f"{suite.seed}:{name}")
        context = GenContext(rng, tokenizer, suite.task_context(name))
        rows[name] = TASKS[name].rows(context, size)
    return rows


def write_folder(path: Path, suite: EvalSuite, tokenizer: Tokenizer) -> None:
    """Generate and write the suite into path atomically (a temporary folder renamed)."""
    rows = generate_rows(suite, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    try:
        for name, task_rows in rows.items():
            data_file = path / f"{name}.jsonl"
            lines = "".join(json.dumps(row) + "\n" for row in task_rows)
            (staging / data_file.name).write_text(lines)
            config = task_yaml(name, TASKS[name].kind, data_file)
            (staging / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        longest = max(
            request_tokens(TASKS[name].kind, row, tokenizer)
            for name, task_rows in rows.items()
            for row in task_rows
        )
        manifest = {"suite": suite.to_dict(), "tasks": list(rows), "max_tokens": longest}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        os.replace(staging, path)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (path / MANIFEST).is_file():  # not another process finishing first
            raise


def task_folder(suite: EvalSuite, tokenizer: Tokenizer, root: Path) -> TaskFolder:
    """The suite's task folder under root, written on first use."""
    path = root / "tasks" / f"{suite.data_fingerprint()}-{code_fingerprint(*GENERATOR_CODE)}"
    if not (path / MANIFEST).is_file():
        logger.info("writing the %s suite's tasks to %s", suite.name, path)
        write_folder(path, suite, tokenizer)
    manifest = json.loads((path / MANIFEST).read_text())
    rows = {
        name: [json.loads(line) for line in (path / f"{name}.jsonl").read_text().splitlines()]
        for name in manifest["tasks"]
    }
    return TaskFolder(path, rows, manifest["max_tokens"])
