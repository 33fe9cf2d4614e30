"""The suite on the embedded SmolLM2-135M: agreement with lm-eval's own `hf` model, a baseline
above chance, a degraded policy measurably worse, and `kvtune evaluate` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import yaml
from lm_eval.tasks import TaskManager

from kvtune.autotune.evaluation import EvalSuite, KVTuneLM, evaluate, load_suite
from kvtune.autotune.evaluation.baseline_cache import baseline_run
from kvtune.autotune.evaluation.task_files import TaskFolder, task_folder
from kvtune.autotune.evaluation.tasks import TASKS
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer

KVTUNE = [
    sys.executable,
    "-c",
    "import sys; from kvtune.autotune.cli.main import main; sys.exit(main())",
]
# Small and seeded: every QA task, long enough that the KV cache carries the answer.
SMALL = {
    "name": "small",
    "seed": 3,
    "context_tokens": 512,
    "tasks": {
        "wiki_ppl": {"docs": 1},
        "passkey": {"docs": 2},
        "multikey": {"docs": 1, "questions": 4},
        "codes": {"docs": 1, "questions": 4},
    },
}
FP16 = KVPolicy(k_dtype="fp16", v_dtype="fp16")
FP4_PER_TENSOR = KVPolicy(k_dtype="fp4", v_dtype="fp4", group_size="tensor")


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-cache")


def samples_by_doc(lm, folder: TaskFolder) -> dict[str, list]:
    names = [folder.lm_eval_name(task) for task in folder.rows]
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=TaskManager(include_path=str(folder.path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    return {
        name: [
            s["resps"][0][0] for s in sorted(results["samples"][name], key=lambda s: s["doc_id"])
        ]
        for name in names
    }


@pytest.mark.slow
def test_loglikelihoods_equal_lm_eval_hf_model(eval_cache):
    from lm_eval.models.huggingface import HFLM

    model_folder = resolve_model("smollm2-135m")
    suite = EvalSuite(
        context_tokens=256,
        tasks={
            "passkey": {"docs": 2},
            "codes": {"docs": 1, "questions": 2},
            "wiki_ppl": {"docs": 1},
        },
    )
    folder = task_folder(suite, Tokenizer.from_folder(model_folder), eval_cache)
    ours = samples_by_doc(KVTuneLM("smollm2-135m", {"k_dtype": "auto", "v_dtype": "auto"}), folder)
    hf = HFLM(pretrained=str(model_folder), device="cpu", dtype="float32", batch_size=4)
    theirs = samples_by_doc(hf, folder)
    count = 0
    for name, values in ours.items():
        for mine, reference in zip(values, theirs[name], strict=True):
            mine, reference = (mine, reference) if "wiki" in name else (mine[0], reference[0])
            assert mine == pytest.approx(reference, abs=1e-3), name
            count += 1
    assert count == 2 + 2 + 1


@pytest.mark.slow
def test_baseline_is_above_chance_on_every_task_of_the_quick_suite(eval_cache):
    suite = load_suite("quick")
    model_folder = resolve_model(suite.model)
    folder = task_folder(suite, Tokenizer.from_folder(model_folder), eval_cache)
    run, computed = baseline_run(suite, folder, model_folder, eval_cache)
    assert computed
    for name, score in run.tasks.items():
        chance = TASKS[name].chance
        if chance is None:  # perplexity: a uniform guess would be ~49K
            assert score.score < 200, name
        else:
            assert score.score > chance + 0.2, (name, score.score)
            assert score.exact_match > chance + 0.2, (name, score.exact_match)
    assert baseline_run(suite, folder, model_folder, eval_cache)[1] is False  # now cached


@pytest.mark.slow
def test_fp4_per_tensor_scores_below_fp16_which_keeps_the_baseline(eval_cache):
    fp16 = evaluate(FP16, SMALL, eval_cache)
    fp4 = evaluate(FP4_PER_TENSOR, SMALL, eval_cache)
    assert fp16["accuracy_retention"] > 0.95
    assert fp16["kl"] < 1e-3 and fp16["top1_agreement"] > 0.99
    assert fp4["accuracy_retention"] < fp16["accuracy_retention"] - 0.3
    assert fp4["kl"] > 100 * fp16["kl"]
    wiki = fp4["tasks"]["wiki_ppl"]
    assert wiki["score"] > 1.2 * wiki["baseline_score"]  # perplexity up
    assert fp4["baseline_seconds"] == 0.0  # the fp16 call paid for the baseline
    for name, task in fp16["tasks"].items():
        assert task["baseline_score"] == fp4["tasks"][name]["baseline_score"]


def kvtune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTUNE, *args], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_bad_settings_fail_in_one_line_before_any_model_loads(tmp_path):
    for override, field in [
        ("policy.k_dtype=fp3", "policy.k_dtype"),
        ("eval.seed=-2", "eval.seed"),
    ]:
        result = kvtune("evaluate", override, "format=json", cwd=tmp_path)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.strip().startswith(f"kvtune evaluate: error: {field}=")
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_evaluate_command_prints_one_json_object(tmp_path, eval_cache):
    presets = tmp_path / "conf"
    (presets / "eval").mkdir(parents=True)
    (presets / "eval" / "small.yaml").write_text(yaml.safe_dump(SMALL))
    result = kvtune(
        "evaluate",
        f"hydra.searchpath=[file://{presets}]",
        "eval=small",
        f"cache={eval_cache}",
        "policy.k_dtype=fp8",
        "policy.v_dtype=fp8",
        "format=json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["suite"] == "small"
    assert output["policy"]["k_dtype"] == "fp8"
    assert set(output["tasks"]) == set(SMALL["tasks"])
    keys = ("accuracy_retention", "exact_match_retention", "kl", "top1_agreement", "seconds")
    for key in (*keys, "answer_agreement"):
        assert isinstance(output[key], float), key
    assert 0 <= output["top1_agreement"] <= 1
