"""The greedy generation tasks: their items (20 a task, needles spread over the haystack, each
answer once, turns that extend one another token for token) and their exact-match scoring,
against a re-implementation of lm-eval's documented exact_match here."""

from __future__ import annotations

import re
import string

import lm_eval
import pytest
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

import kvtune.autotune.evaluation  # noqa: F401  (HF offline variables)
from kvtune.autotune.evaluation.scoring import task_score
from kvtune.autotune.evaluation.shared_generation import cut_at_stops
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import task_folder
from kvtune.autotune.evaluation.tasks import GENERATION, TASKS
from kvtune.autotune.evaluation.tasks.greedy import STOP
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

GREEDY = ("passkey_greedy", "multikey_greedy", "codes_greedy")
CONTEXT = 4096
SUITE = EvalSuite(
    seed=5,
    context_tokens=CONTEXT,
    tasks={name: {"docs": 4, "questions": 5} for name in GREEDY},
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def folder(tokenizer, tmp_path_factory):
    return task_folder(SUITE, tokenizer, tmp_path_factory.mktemp("greedy"))


def conversations(rows: list[dict]) -> list[list[dict]]:
    by_doc: dict[int, list[dict]] = {}
    for row in rows:
        by_doc.setdefault(row["doc"], []).append(row)
    return [sorted(turns, key=lambda r: r["turn"]) for turns in by_doc.values()]


@pytest.mark.parametrize("name", GREEDY)
def test_twenty_items_each_answer_once_in_its_haystack(folder, tokenizer, name):
    rows = folder.rows[name]
    assert TASKS[name].kind == GENERATION
    assert len(rows) == 20
    assert len({row["answer"] for row in rows}) == 20
    for turns in conversations(rows):
        assert [row["turn"] for row in turns] == list(range(5))
        document = turns[0]["context"]
        first = len(tokenizer.encode(document))
        assert 0.9 * CONTEXT <= first <= 1.05 * CONTEXT
        for row in turns:
            assert row["answer"].isdigit()
            # Once in the haystack; the earlier turns' gold answers are other numbers.
            assert document.count(row["answer"]) == 1
            assert row["context"].count(row["answer"]) == 1


@pytest.mark.parametrize("name", GREEDY)
def test_needles_are_spread_over_the_haystack(folder, name):
    """Each fifth of the haystack holds an asked needle, and the recorded depth is where the
    answer really is (its character offset in the first prompt, which is mostly haystack)."""
    rows = folder.rows[name]
    measured = []
    for turns in conversations(rows):
        document = turns[0]["context"]
        for row in turns:
            offset = document.index(row["answer"]) / len(document)
            assert offset == pytest.approx(row["depth"], abs=0.08)
            measured.append(offset)
    for fifth in range(5):
        assert any(fifth / 5 <= offset < (fifth + 1) / 5 for offset in measured), fifth


@pytest.mark.parametrize("name", GREEDY)
def test_each_turns_prompt_is_a_token_prefix_of_the_next(folder, tokenizer, name):
    """What lets the turns of a haystack share its prefill: the prompt stops before the answer's
    space, and the next turn's prompt carries the gold answer after it."""
    for turns in conversations(folder.rows[name]):
        for row, after in zip(turns, turns[1:], strict=False):
            ids, later = tokenizer.encode(row["context"]), tokenizer.encode(after["context"])
            assert later[: len(ids)] == ids
            assert not row["context"][-1].isspace()
            assert after["context"][len(row["context"]) :].startswith(" " + row["answer"])


def lm_eval_exact_match(prediction: str, reference: str) -> float:
    """lm-eval's exact_match as its task config asks for it (the HF `exact_match` metric,
    re-implemented from its documentation): each regex to ignore removed from both strings,
    then punctuation removed (string.punctuation), then equality."""
    for pattern in (r"^\s+", r"\s+$"):
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    table = str.maketrans("", "", string.punctuation)
    return float(prediction.translate(table) == reference.translate(table))


def variants(answer: str) -> list[str]:
    """Generated texts around a gold answer, right and wrong."""
    return [
        f" {answer}",
        f"{answer}",
        f" {answer},",
        f" {answer}7",
        f" {answer[:-1]}",
        f" {answer} is the number",
        f"\t{answer} ",
        f" ({answer})",
        f" {answer[::-1]}",
        " ",
    ]


class CannedLM(LM):
    """Answers each generation request with one of the variants of its gold answer."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: dict[str, str] = {}

    def generate_until(self, requests):
        out = []
        for number, request in enumerate(requests):
            text = variants(request.doc["answer"])[number % 10]
            self.texts[request.args[0]] = text
            out.append(text)
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


@pytest.mark.parametrize("name", GREEDY)
def test_exact_match_scores_as_lm_eval_documents_it(folder, name):
    lm = CannedLM()
    manager = TaskManager(include_path=str(folder.path), include_defaults=False)
    task = folder.lm_eval_name(name)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=manager, bootstrap_iters=0, log_samples=True
    )
    samples = results["samples"][task]
    expected = {
        sample["doc"]["context"]: lm_eval_exact_match(
            lm.texts[sample["doc"]["context"]], sample["doc"]["answer"]
        )
        for sample in samples
    }
    assert {s["doc"]["context"]: s["exact_match"] for s in samples} == expected
    assert 0 < sum(expected.values()) < len(expected)  # right and wrong ones both scored
    score = task_score(GENERATION, samples)
    assert score.score == pytest.approx(sum(expected.values()) / len(expected))
    assert score.exact_match == score.score


@pytest.mark.parametrize(
    "text",
    ["12345.", " 12345\nThe pass key", "123.45 dollars", "12345<|im_end|>x", "no stop", ".x\n"],
)
def test_generated_text_is_cut_at_the_first_stop(text):
    earliest = min((text.find(s) for s in STOP if s in text), default=len(text))
    assert cut_at_stops(text, STOP) == text[:earliest]
