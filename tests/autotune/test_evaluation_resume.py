"""A killed evaluation resumes at the runtime call (haystack) where it stopped.

On the real SmolLM2 through the real lm-eval path, on a small suite where every haystack and
document is its own runtime call: an evaluation killed twice (once in the baseline, once in the
policy's run) and rerun reports exactly what one uninterrupted run reports, and the prefills of
the three runs add up to the uninterrupted run's (nothing stored is computed again). Prefills
are counted at the engine (Engine.add_request), independent of the unit cache.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.autotune.cache import replace_atomically
from kvtune.autotune.evaluation import evaluate, load_suite
from kvtune.autotune.evaluation.baseline_cache import BASELINE_POLICY
from kvtune.autotune.evaluation.suite_run import run_suite
from kvtune.autotune.evaluation.task_files import TaskFolder, task_folder, task_yaml
from kvtune.autotune.evaluation.tasks import TASKS
from kvtune.autotune.evaluation.unit_cache import UnitCache, UnitRuns
from kvtune.runtime import KVPolicy
from kvtune.runtime.engine import Engine
from kvtune.runtime.llm import LLM
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

# Every prompt is longer than batch_tokens, so each haystack is one runtime call, as at 8K and
# 16K in the long suites. Both kinds of call: scoring (passkey; wiki_ppl's rolling windows take
# the same path) and greedy generation (two questions a haystack).
SUITE = {
    "name": "resume",
    "model": "smollm2-135m",
    "seed": 3,
    "context_tokens": 256,
    "tasks": {
        "passkey": {"docs": 2},
        "passkey_greedy": {"docs": 2, "questions": 2},
    },
    "kl_tail_tokens": 4,
    "batch_tokens": 256,
    "max_num_seqs": 2,
}
# Per-tensor fp8: its K/V range is fixed, so the clipped fraction is counted too.
POLICY = KVPolicy("fp8", "fp8", group_size="tensor")
OTHER_POLICY = KVPolicy("fp8", "fp4", group_size=16, scale_dtype="e4m3")


class Killed(Exception):
    """Stands for the session's end killing the evaluation mid-run."""


@dataclass
class Prefills:
    """Prompts the engine was given (each one prefill), of them those scored (no token
    generated), the count when the last unit was stored, and the prefill at which to kill the
    run (None: never)."""

    count: int = 0
    scored: int = 0
    stored_at: int = 0
    kill_at: int | None = None

    def restart(self, kill_at: int | None = None) -> None:
        self.count, self.scored, self.stored_at, self.kill_at = 0, 0, 0, kill_at


@pytest.fixture()
def prefills(monkeypatch) -> Prefills:
    counter = Prefills()
    add_request, put = Engine.add_request, UnitCache.put

    def counting(
        self: Engine, prompt_ids: list[int], max_new_tokens: int, *args: Any, **kwargs: Any
    ) -> Any:
        if counter.kill_at is not None and counter.count >= counter.kill_at:
            raise Killed
        counter.count += 1
        counter.scored += max_new_tokens == 0
        return add_request(self, prompt_ids, max_new_tokens, *args, **kwargs)

    def noting(self: UnitCache, key: Any, value: Any) -> None:
        put(self, key, value)
        counter.stored_at = counter.count

    monkeypatch.setattr(Engine, "add_request", counting)
    monkeypatch.setattr(UnitCache, "put", noting)
    return counter


def without_seconds(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in ("seconds", "baseline_seconds")}


@pytest.mark.slow
def test_a_killed_evaluation_resumes_with_the_uninterrupted_scores(tmp_path, prefills):
    reference = evaluate(POLICY, SUITE, tmp_path / "uninterrupted")
    total = prefills.count
    root = tmp_path / "killed"
    finished = 0
    # The first kill falls in the baseline; the second, after the baseline's rest, in the
    # policy's run (each run has about half the prefills).
    for kill_at in (total // 3, 2 * total // 3):
        prefills.restart(kill_at)
        with pytest.raises(Killed):
            evaluate(POLICY, SUITE, root)
        finished += prefills.stored_at
    prefills.restart()
    resumed = evaluate(POLICY, SUITE, root)
    assert 0 < prefills.count < total
    assert finished + prefills.count == total
    assert without_seconds(resumed) == without_seconds(reference)
    assert resumed["kl"] > 0 and resumed["kv_clipped_fraction"] is not None
    assert resumed["tasks"]["passkey_greedy"]["samples"] == 4
    assert not list((root / "units").iterdir())  # stored whole, the journal goes


def edited_folder(folder: TaskFolder, target: Path, task: str, row: int) -> TaskFolder:
    """A copy of the task folder with two words of one row's haystack swapped: other tokens,
    as many of them."""
    shutil.copytree(folder.path, target)
    rows = {name: [dict(r) for r in task_rows] for name, task_rows in folder.rows.items()}
    context = rows[task][row]["context"]
    rows[task][row]["context"] = re.sub(r" ([a-z]{5,}) ([a-z]{5,}) ", r" \2 \1 ", context, count=1)
    for name, task_rows in rows.items():
        data = target / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in task_rows))
        config = task_yaml(name, TASKS[name].kind, data)
        (target / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return TaskFolder(target, rows, folder.max_tokens)


@pytest.mark.slow
def test_another_policy_reference_or_haystack_misses_the_units(tmp_path, prefills):
    suite = load_suite(SUITE)
    tokenizer = Tokenizer.from_folder(resolve_model(suite.model))
    folder = task_folder(suite, tokenizer, tmp_path)
    folder_units = tmp_path / "units"

    def prefilled(policy: KVPolicy, task_folder: TaskFolder, **kwargs: Any) -> int:
        prefills.restart()
        run_suite(policy, suite, task_folder, units=UnitCache(folder_units), **kwargs)
        return prefills.count

    baseline_prefills = prefilled(BASELINE_POLICY, folder)
    scored = prefills.scored
    assert 0 < scored < baseline_prefills
    assert prefilled(BASELINE_POLICY, folder) == 0  # all stored
    assert prefilled(OTHER_POLICY, folder) == baseline_prefills
    baseline = run_suite(BASELINE_POLICY, suite, folder)
    # Against a reference a scored request's record holds the log-probabilities at the
    # reference's top tokens: the scored calls miss, the generated answers still hit.
    assert prefilled(BASELINE_POLICY, folder, reference=baseline.rows) == scored
    edited = edited_folder(folder, tmp_path / "edited", "passkey", 0)
    before, after = (tokenizer.encode(f.rows["passkey"][0]["context"]) for f in (folder, edited))
    assert before != after and len(before) == len(after)
    assert prefilled(BASELINE_POLICY, edited) == 1  # that haystack's one prefill


def test_a_write_killed_midway_leaves_no_entry(tmp_path):
    path = tmp_path / "units" / "entry.pt"

    def half_then_killed(temporary: Path) -> None:
        temporary.write_bytes(b"half a file")
        raise Killed

    with pytest.raises(Killed):
        replace_atomically(path, half_then_killed)
    assert not path.exists() and not list(path.parent.iterdir())
    assert UnitCache(path.parent).get({"unit": 1}) is None


def test_the_unit_key_names_the_model_by_content_not_path(tiny_model_folder, tmp_path):
    copy = shutil.copytree(tiny_model_folder, tmp_path / "copy")
    contexts = [
        UnitRuns(LLM(str(folder), max_model_len=64), str(folder), "torch", None).context
        for folder in (tiny_model_folder, copy)
    ]
    assert contexts[0] == contexts[1]
    text = json.dumps(contexts[0])
    assert str(tmp_path) not in text and str(tiny_model_folder) not in text
