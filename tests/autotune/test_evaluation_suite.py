"""The accuracy suite's settings: presets, validation, fingerprints; scoring and prefill plans."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvtune.autotune.evaluation.prefill_plan import share_prefixes, token_batches
from kvtune.autotune.evaluation.scoring import (
    EXACT_MATCH,
    PRIMARY,
    bootstrap_stderr,
    retention,
    retention_stderr,
    score,
    task_score,
)
from kvtune.autotune.evaluation.suite import TASK_NAMES, EvalSuite, TaskSize, load_suite
from kvtune.autotune.evaluation.tasks import GENERATION, PERPLEXITY, QA, TASKS
from kvtune.runtime.errors import ConfigError

GREEDY_TASKS = {name for name in TASK_NAMES if TASKS[name].kind == GENERATION}
PRESET_GREEDY_TASKS = {
    "quick": set(),
    "heldout": set(),
    "long": set(),
    "full": {"passkey_greedy"},
    "long8k": GREEDY_TASKS,
    "long16k": GREEDY_TASKS,
}


@pytest.mark.parametrize("preset", sorted(PRESET_GREEDY_TASKS))
def test_presets_load_and_cover_every_task(preset):
    suite = load_suite(preset)
    assert suite.name == preset
    scored = set(TASK_NAMES) - GREEDY_TASKS
    # Every probability-scored task everywhere; greedy generation in the larger presets.
    assert set(suite.tasks) == scored | PRESET_GREEDY_TASKS[preset]
    assert EvalSuite.from_dict(suite.to_dict()) == suite


def test_the_task_names_are_the_registered_tasks():
    assert set(TASK_NAMES) == set(TASKS)


@pytest.mark.parametrize(
    ("preset", "tokens", "seed"), [("long8k", 8192, 8), ("long16k", 16384, 16)]
)
def test_the_long_suites_run_on_the_long_model_with_twenty_greedy_items_a_task(
    preset, tokens, seed
):
    suite = load_suite(preset)
    assert (suite.model, suite.seed) == ("qwen2.5-coder-0.5b", seed)
    assert all(suite.task_context(name) == tokens for name in suite.tasks)
    for name in GREEDY_TASKS:
        assert suite.tasks[name].docs * suite.tasks[name].questions >= 20


def test_the_quick_suite_recalls_among_several_needles_at_two_thousand_tokens():
    quick = load_suite("quick")
    assert quick.task_context("multikey") >= 2048 and quick.task_context("codes") >= 2048


def test_the_full_suite_asks_greedy_pass_keys_at_four_thousand_tokens():
    assert load_suite("full").task_context("passkey_greedy") >= 4096


def test_the_long_suite_asks_every_task_at_seven_thousand_tokens():
    """Where a fixed selection budget is under a quarter of the context (issue 13's 0.10)."""
    long = load_suite("long")
    assert all(long.task_context(name) >= 7168 for name in long.tasks)


@pytest.mark.parametrize("larger", ["heldout", "long", "full", "long8k", "long16k"])
def test_larger_presets_hold_out_longer_contexts_and_more_documents(larger):
    quick, other = load_suite("quick"), load_suite(larger)
    assert other.context_tokens > quick.context_tokens
    assert other.seed != quick.seed  # held-out documents, not the quick ones again
    for name in quick.tasks:
        assert other.tasks[name].docs >= quick.tasks[name].docs
        assert other.tasks[name].questions >= quick.tasks[name].questions


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"context_tokens": 100}, "eval.context_tokens"),
        ({"context_tokens": 100_000}, "eval.context_tokens"),
        ({"seed": -1}, "eval.seed"),
        ({"tasks": {}}, "eval.tasks"),
        ({"tasks": {"lambada": {"docs": 1}}}, "eval.tasks.lambada"),
        ({"tasks": {"passkey": {"docs": 0}}}, "eval.tasks.passkey.docs"),
        ({"tasks": {"passkey": {"docs": 1, "depth": 2}}}, "eval.tasks.passkey"),
        ({"batch_tokens": 10}, "eval.batch_tokens"),
        (
            {"tasks": {"passkey": {"docs": 1, "context_tokens": 100}}},
            "eval.tasks.passkey.context_tokens",
        ),
        # batch_tokens must hold the longest haystack, a task's own length included.
        (
            {
                "batch_tokens": 4096,
                "tasks": {"passkey_greedy": {"docs": 1, "context_tokens": 6000}},
            },
            "eval.batch_tokens",
        ),
        ({"colour": "red"}, "eval.colour"),
    ],
)
def test_bad_settings_name_the_field(changes, field):
    with pytest.raises(ConfigError) as error:
        EvalSuite.from_dict({**load_suite("quick").to_dict(), **changes})
    assert error.value.field == field


@pytest.mark.parametrize(
    ("model", "limit"), [("smollm2-135m", 8192), ("qwen2.5-coder-0.5b", 32768)]
)
@pytest.mark.parametrize("where", ["suite", "task"])
def test_a_context_longer_than_the_models_positions_is_one_line_naming_the_field(
    model, limit, where
):
    """The limit is the model preset's max_position_embeddings (conf/model/<model>.yaml)."""

    def suite(tokens: int) -> EvalSuite:
        if where == "suite":
            return EvalSuite(
                model=model,
                context_tokens=tokens,
                batch_tokens=tokens,
                tasks={"passkey": {"docs": 1}},
            )
        return EvalSuite(
            model=model,
            batch_tokens=tokens,
            tasks={"passkey": {"docs": 1, "context_tokens": tokens}},
        )

    assert suite(limit).task_context("passkey") == limit
    with pytest.raises(ConfigError) as error:
        suite(limit + 1)
    field = "eval.context_tokens" if where == "suite" else "eval.tasks.passkey.context_tokens"
    assert error.value.field == field
    message = str(error.value)
    assert "\n" not in message
    assert f"max_position_embeddings ({limit} tokens)" in message and model in message


def test_a_suite_model_read_from_a_local_folder_limits_its_context(tmp_path):
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    EvalSuite(model=str(tmp_path), context_tokens=2048, tasks={"passkey": {"docs": 1}})
    with pytest.raises(ConfigError, match=r"max_position_embeddings \(2048 tokens\)"):
        EvalSuite(model=str(tmp_path), context_tokens=2049, tasks={"passkey": {"docs": 1}})


def test_an_unknown_suite_model_lists_the_presets():
    with pytest.raises(ConfigError, match="qwen2.5-coder-0.5b") as error:
        EvalSuite(model="no-such-model", tasks={"passkey": {"docs": 1}})
    assert error.value.field == "eval.model"


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="quick"):
        load_suite("nonexistent")


def test_fingerprints_follow_what_decides_the_results():
    suite = load_suite("quick")
    renamed = EvalSuite.from_dict({**suite.to_dict(), "name": "other"})
    reseeded = EvalSuite.from_dict({**suite.to_dict(), "seed": 7})
    on_gpu = EvalSuite.from_dict({**suite.to_dict(), "device": "cuda", "backend": "triton"})
    assert renamed.run_fingerprint() == suite.run_fingerprint()
    assert reseeded.data_fingerprint() != suite.data_fingerprint()
    # The runtime changes the scores, not the generated task files.
    assert on_gpu.data_fingerprint() == suite.data_fingerprint()
    assert on_gpu.run_fingerprint() != suite.run_fingerprint()


def test_task_sizes_accept_mappings():
    suite = EvalSuite(tasks={"passkey": {"docs": 3}})
    assert suite.tasks == {"passkey": TaskSize(docs=3, questions=1)}


def test_a_task_may_run_at_its_own_context_length():
    suite = EvalSuite(
        context_tokens=1024,
        tasks={"passkey": {"docs": 1}, "passkey_greedy": {"docs": 2, "context_tokens": 4096}},
    )
    assert suite.task_context("passkey") == 1024
    assert suite.task_context("passkey_greedy") == 4096
    assert EvalSuite.from_dict(suite.to_dict()) == suite
    assert "context_tokens" not in suite.to_dict()["tasks"]["passkey"]


def test_bootstrap_stderr_of_a_mean_is_near_the_analytic_one():
    values = np.array([[1.0], [0.0]] * 50)
    stderr = bootstrap_stderr(PRIMARY[QA], values, iters=4000)
    assert stderr == pytest.approx(0.5 / math.sqrt(100), rel=0.1)
    assert bootstrap_stderr(PRIMARY[QA], np.ones((10, 1))) == 0.0
    assert bootstrap_stderr(PRIMARY[QA], np.ones((1, 1))) is None


def test_word_perplexity_weights_documents_by_words():
    metric = PRIMARY[PERPLEXITY]
    values = np.array([[-10.0, 10.0], [-30.0, 10.0]])  # (log-likelihood, words)
    assert score(metric, values) == pytest.approx(math.exp(40 / 20))


def test_retention_goes_the_right_way_for_each_metric():
    assert retention(PRIMARY[QA], 0.5, 1.0) == 0.5
    assert retention(PRIMARY[QA], 0.5, 0.0) is None
    assert retention(PRIMARY[PERPLEXITY], 40.0, 20.0) == 0.5  # perplexity doubled
    assert retention(PRIMARY[PERPLEXITY], 0.0, 20.0) is None


def test_paired_retention_stderr_moves_only_with_the_changed_samples():
    rng = np.random.default_rng(0)
    baseline = rng.uniform(0.2, 1.0, size=(40, 1))
    assert retention_stderr(PRIMARY[QA], baseline.copy(), baseline) == 0.0
    halved = baseline * 0.5  # every sample loses half: retention is exactly 0.5 in any resample
    assert retention_stderr(PRIMARY[QA], halved, baseline) == pytest.approx(0.0, abs=1e-12)
    one_lost = baseline.copy()
    one_lost[0] = 0.0
    paired = retention_stderr(PRIMARY[QA], one_lost, baseline)
    unpaired = bootstrap_stderr(PRIMARY[QA], one_lost) / score(PRIMARY[QA], baseline)
    assert 0 < paired < unpaired / 2
    assert retention_stderr(PRIMARY[QA], baseline[:1], baseline[:1]) is None
    with pytest.raises(ValueError, match="same samples"):
        retention_stderr(PRIMARY[QA], baseline[:3], baseline)


def test_perplexity_retention_stderr_is_paired_too():
    words = np.full((20, 1), 10.0)
    baseline = np.hstack([np.linspace(-40, -20, 20)[:, None], words])
    worse = baseline.copy()
    worse[:, 0] *= 1.1  # every document's log-likelihood 10% lower
    stderr = retention_stderr(PRIMARY[PERPLEXITY], worse, baseline)
    assert stderr is not None and stderr < 0.01  # the same shift in every resample


def test_task_scores_read_lm_eval_samples_in_document_order():
    samples = [
        {"doc_id": 1, "perplexity": math.log(0.25), "acc": 0},
        {"doc_id": 0, "perplexity": math.log(0.75), "acc": 1},
    ]
    result = task_score(QA, samples)
    assert result.metric == "answer_probability"
    assert result.score == pytest.approx(0.5)
    assert result.values == [[pytest.approx(0.75)], [pytest.approx(0.25)]]
    assert result.exact_match == 0.5 and result.exact_match_values == [[1.0], [0.0]]
    assert EXACT_MATCH.values(samples).tolist() == [[1.0], [0.0]]
    generated = task_score(
        GENERATION, [{"doc_id": 0, "exact_match": 1.0}, {"doc_id": 1, "exact_match": 0.0}]
    )
    assert generated.metric == "exact_match" and generated.score == 0.5
    assert generated.exact_match == 0.5 and generated.values == [[1.0], [0.0]]
    ppl = task_score(PERPLEXITY, [{"doc_id": 0, "word_perplexity": (-20.0, 10)}])
    assert ppl.score == pytest.approx(math.exp(2.0)) and ppl.exact_match is None
    assert ppl.stderr is None  # one document: no bootstrap


def test_prefixes_share_the_longest_pass():
    inputs = [[1, 2], [1, 2, 3, 4], [1, 2, 3], [2, 3], [1, 2, 3, 4]]
    serving = share_prefixes(inputs)
    assert serving == [1, 1, 1, 3, 1]
    for index, host in enumerate(serving):
        assert inputs[host][: len(inputs[index])] == inputs[index]


def test_token_batches_bound_the_tokens_of_a_call():
    assert token_batches([3, 3, 3, 10, 1], 6) == [[0, 1], [2], [3], [4]]


def test_evaluate_table_fits_an_80_column_terminal_without_truncation():
    from rich.console import Console

    from kvtune.autotune.cli.evaluate import render_result

    qa = {
        "metric": "answer_probability",
        "score": 0.343,
        "stderr": 0.039,
        "baseline_score": 0.479,
        "retention": 0.717,
        "exact_match": 1.0,
        "baseline_exact_match": 1.0,
        "kl": 0.0123,
        "top1_agreement": 1.0,
    }
    ppl = {**qa, "metric": "word_perplexity", "score": 51.518, "exact_match": None}
    result = {
        "suite": "quick",
        "model": "smollm2-135m",
        "tasks": {"wiki_ppl": ppl, "passkey": qa, "multikey": qa, "codes": qa, "doc_mcq": qa},
        "accuracy_retention": 0.978,
        "exact_match_retention": 1.0,
        "kl": 0.0136,
        "top1_agreement": 0.966,
        "answer_agreement": 0.812,
        "seconds": 58.2,
        "baseline_seconds": 0.0,
    }
    console = Console(width=80, record=True)
    render_result(result, console)
    text = console.export_text()
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "1.00/1.00" in text and "multikey" in text and "answer_probability" in text
