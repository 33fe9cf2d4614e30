"""The generated tasks: deterministic, answers exactly once, the requested lengths, and lm-eval
turns the written YAML/JSONL into exactly the generated requests."""

from __future__ import annotations

import random

import lm_eval
import pytest
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

import kvtune.autotune.evaluation  # noqa: F401  (HF offline variables)
from kvtune.autotune.evaluation import haystack
from kvtune.autotune.evaluation.scoring import task_score
from kvtune.autotune.evaluation.suite import EvalSuite, TaskSize
from kvtune.autotune.evaluation.task_files import generate_rows, task_folder
from kvtune.autotune.evaluation.tasks import (
    GENERATION,
    QA,
    TASKS,
    GenContext,
    codes,
    doc_mcq,
    multikey,
    passkey,
)
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

SUITE = EvalSuite(
    context_tokens=768,
    tasks={
        "wiki_ppl": {"docs": 2},
        "passkey": {"docs": 3},
        "multikey": {"docs": 2, "questions": 3},
        "codes": {"docs": 2, "questions": 4},
        "doc_mcq": {"docs": 2, "questions": 3},
    },
)
DRAWS = {"passkey": passkey.draw, "multikey": multikey.draw, "codes": codes.draw}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def rows(tokenizer):
    return generate_rows(SUITE, tokenizer)


def test_generation_is_deterministic_and_seeded(tokenizer, rows):
    assert generate_rows(SUITE, tokenizer) == rows
    reseeded = generate_rows(EvalSuite.from_dict({**SUITE.to_dict(), "seed": 1}), tokenizer)
    for name in rows:
        assert reseeded[name] != rows[name]


def test_a_task_draws_the_same_rows_whatever_the_other_tasks(tokenizer, rows):
    alone = EvalSuite(context_tokens=768, tasks={"codes": SUITE.tasks["codes"]})
    assert generate_rows(alone, tokenizer)["codes"] == rows["codes"]


def test_every_question_is_a_row(rows):
    for name, size in SUITE.tasks.items():
        assert len(rows[name]) == size.docs * size.questions
        if TASKS[name].kind == QA:
            assert [row["turn"] for row in rows[name]] == list(range(size.questions)) * size.docs


@pytest.mark.parametrize("name", ["passkey", "multikey", "codes", "doc_mcq"])
def test_each_answer_is_in_its_document_exactly_once(name, tokenizer):
    draw = DRAWS.get(name, doc_mcq.draw)
    context = GenContext(random.Random(3), tokenizer, 768)
    size = SUITE.tasks[name]
    for doc in range(4):
        conversation = draw(context, doc, size)
        answers = [q.answer for q in conversation.questions]
        assert len(answers) == size.questions
        assert len(set(answers)) == len(answers)
        for answer in answers:
            assert conversation.document.count(answer) == 1, (name, answer)


@pytest.mark.parametrize("name", ["passkey", "multikey", "codes"])
def test_a_prompt_holds_only_its_own_answer_and_earlier_turns(name, rows):
    for row in rows[name]:
        # The document once; earlier answers only as earlier assistant turns.
        assert row["context"].count(row["answer"]) == 1
        assert row["context"].startswith("<|im_start|>system")


def test_prompts_have_the_requested_length(rows, tokenizer):
    for name, task_rows in rows.items():
        field = "context" if TASKS[name].kind == QA else "text"
        first_turns = [row for row in task_rows if row.get("turn", 0) == 0]
        for row in first_turns:
            tokens = len(tokenizer.encode(row[field]))
            assert 0.9 * SUITE.context_tokens <= tokens <= 1.05 * SUITE.context_tokens, name


def test_passkey_depths_spread_over_the_documents(tokenizer):
    context = GenContext(random.Random(0), tokenizer, 768)
    size = TaskSize(docs=4)
    for doc in range(size.docs):
        conversation = passkey.draw(context, doc, size)
        key = conversation.questions[0].answer
        position = conversation.document.index(key) / len(conversation.document)
        assert abs(position - (doc + 0.5) / size.docs) < 0.2


def test_perplexity_documents_are_held_out_of_every_haystack(rows):
    haystack_texts = {p.text for p in haystack.haystack_paragraphs()}
    for row in rows["wiki_ppl"]:
        for paragraph in row["text"].split("\n\n"):
            assert paragraph not in haystack_texts


def test_doc_mcq_lists_four_options_with_the_answer(rows):
    for row in rows["doc_mcq"]:
        question = row["context"].rsplit("<|im_start|>user\n", 1)[1]
        options = [line for line in question.splitlines() if line.startswith("- ")]
        assert len(options) == 4
        assert sum(row["answer"] in option for option in options) == 1


def test_too_many_questions_for_a_task_is_refused(tokenizer):
    with pytest.raises(ConfigError, match="eval.tasks.passkey.questions"):
        generate_rows(EvalSuite(tasks={"passkey": {"docs": 1, "questions": 2}}), tokenizer)


class RecordingLM(LM):
    """Answers every request with a constant and keeps what lm-eval asked."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, list[tuple]] = {}

    def loglikelihood(self, requests):
        self.requests["loglikelihood"] = [r.args for r in requests]
        return [(-1.0, True) for _ in requests]

    def loglikelihood_rolling(self, requests):
        self.requests["loglikelihood_rolling"] = [r.args for r in requests]
        return [-100.0 for _ in requests]

    def generate_until(self, requests):
        raise AssertionError("the suite has no generation tasks")


def test_lm_eval_asks_exactly_the_generated_requests(tmp_path, tokenizer):
    folder = task_folder(SUITE, tokenizer, tmp_path)
    assert task_folder(SUITE, tokenizer, tmp_path) == folder  # written once, then reused
    lm = RecordingLM()
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    names = [folder.lm_eval_name(task) for task in folder.rows]
    results = lm_eval.simple_evaluate(
        model=lm, tasks=names, task_manager=manager, bootstrap_iters=0
    )
    qa = {
        (row["context"], row["answer"])
        for t in folder.rows
        if t != "wiki_ppl"
        for row in folder.rows[t]
    }
    assert set(lm.requests["loglikelihood"]) == qa
    assert {r[0] for r in lm.requests["loglikelihood_rolling"]} == {
        row["text"] for row in folder.rows["wiki_ppl"]
    }
    assert results["results"][folder.lm_eval_name("passkey")]["acc,none"] == 1.0
    longest = max(len(tokenizer.encode(c + a)) for c, a in qa)
    assert folder.max_tokens >= longest


class AnsweringLM(RecordingLM):
    """Writes the gold key (after a space, as a tokenizer may) for the first generation
    request and the key plus one for the rest."""

    def generate_until(self, requests):
        self.requests["generate_until"] = [r.args for r in requests]
        keys = [request.doc["answer"] for request in requests]
        return [f" {keys[0]}"] + [str(int(key) + 1) for key in keys[1:]]


def test_greedy_pass_keys_are_generated_at_their_own_length_and_scored_by_exact_match(
    tmp_path, tokenizer
):
    suite = EvalSuite(
        context_tokens=768,
        tasks={"passkey": {"docs": 1}, "passkey_greedy": {"docs": 2, "context_tokens": 1536}},
    )
    folder = task_folder(suite, tokenizer, tmp_path)
    needles = folder.rows["passkey_greedy"]
    for row in needles:
        assert TASKS["passkey_greedy"].kind == GENERATION
        assert row["context"].count(row["answer"]) == 1
        assert 0.9 * 1536 <= len(tokenizer.encode(row["context"])) <= 1.05 * 1536
    assert folder.max_tokens >= max(len(tokenizer.encode(r["context"])) for r in needles) + 5
    lm = AnsweringLM()
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    name = folder.lm_eval_name("passkey_greedy")
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[name], task_manager=manager, bootstrap_iters=0, log_samples=True
    )
    asked = lm.requests["generate_until"]
    assert {context for context, _ in asked} == {row["context"] for row in needles}
    assert all(kwargs["do_sample"] is False and "." in kwargs["until"] for _, kwargs in asked)
    # One key right, one off by one: half the keys, exactly.
    assert results["results"][name]["exact_match,none"] == 0.5
    assert task_score(GENERATION, results["samples"][name]).score == 0.5
