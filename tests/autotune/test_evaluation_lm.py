"""The `kvtune` lm-eval model against lm-eval's request/response contract, on a tiny random
Llama (word-level tokenizer: "w5 w17 ..." is one token a word)."""

from __future__ import annotations

import json
import random

import lm_eval
import pytest
import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from kvtune.autotune.evaluation import KVTuneLM
from kvtune.autotune.evaluation.fidelity import FidelityRecorder
from tests.runtime.conftest import TINY_VOCAB, build_tiny_model

AUTO = {"k_dtype": "auto", "v_dtype": "auto", "block_size": 8, "chunk_size": 16}


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-eval"), "llama")


@pytest.fixture(scope="module")
def lm(tiny_llama_folder) -> KVTuneLM:
    return KVTuneLM(str(tiny_llama_folder), AUTO, max_model_len=128, batch_tokens=256)


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(1, TINY_VOCAB)}" for _ in range(count))


def request(kind: str, *args, doc_id: int = 0) -> Instance:
    return Instance(kind, doc={}, arguments=args, idx=0, metadata=("tiny", doc_id, 1))


def reference_loglikelihood(lm: KVTuneLM, context: str, continuation: str):
    """Log-likelihood and greedy match computed directly from one prompt's logits."""
    context_ids = lm.tok_encode(context)
    continuation_ids = lm.tok_encode(continuation)
    logits = lm.llm.prompt_logits(context_ids + continuation_ids[:-1])
    rows = torch.log_softmax(logits[len(context_ids) - 1 :], dim=-1)
    targets = torch.tensor(continuation_ids)
    logprob = float(rows.gather(1, targets[:, None]).sum())
    return logprob, bool((rows.argmax(-1) == targets).all())


def test_registered_as_kvtune_with_policy_fields_from_the_command_line(tiny_llama_folder):
    assert get_model("kvtune") is KVTuneLM
    lm = KVTuneLM.create_from_arg_string(
        f"model={tiny_llama_folder},k_dtype=fp8,v_dtype=fp4,group_size=16,max_model_len=64",
        {"batch_size": 2, "device": "cpu"},
    )
    assert (lm.policy.k_dtype, lm.policy.v_dtype, lm.policy.group_size) == ("fp8", "fp4", 16)
    assert lm.max_length == 64


def test_loglikelihood_matches_the_logits_in_request_order(lm):
    contexts = [words(30, seed) for seed in range(4)]
    pairs = [(c, " " + words(3, 10 + i)) for i, c in enumerate(contexts)]
    # A request that extends another's prompt reads its logits from the longer pass.
    pairs.append((pairs[0][0] + pairs[0][1], " " + words(2, 99)))
    results = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    assert len(results) == len(pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, results, strict=True):
        assert isinstance(logprob, float) and isinstance(greedy, bool)
        expected_logprob, expected_greedy = reference_loglikelihood(lm, context, continuation)
        assert logprob == pytest.approx(expected_logprob, abs=1e-4)
        assert greedy == expected_greedy


def test_is_greedy_is_true_for_the_models_own_greedy_continuation(lm):
    context = words(20, 5)
    generated = lm.llm.generate([lm.tok_encode(context)], max_new_tokens=4)[0]
    continuation = " " + lm.tok_decode(generated.token_ids)
    [(logprob, greedy)] = lm.loglikelihood([request("loglikelihood", context, continuation)])
    assert greedy and logprob < 0


def test_rolling_predicts_every_token_once_across_windows(tiny_llama_folder):
    recorder = FidelityRecorder()
    lm = KVTuneLM(str(tiny_llama_folder), AUTO, max_model_len=32, observer=recorder)
    text = words(70, 3)
    [total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    windows = [key for key in recorder.rows if key[0] == text]
    assert len(windows) == 3  # 70 tokens through windows of 32
    assert sum(recorder.rows[key].top_ids.shape[0] for key in windows) == 70
    assert total < 0
    # One window when the text fits: the sum over tokens after the prefix token.
    short = words(20, 4)
    [short_total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", short)])
    ids = lm.tok_encode(short)
    logits = lm.llm.prompt_logits([lm.prefix_token_id, *ids[:-1]])
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).sum()
    assert short_total == pytest.approx(float(expected), abs=1e-4)


def test_observer_sees_the_prompt_tail_then_the_answer(tiny_llama_folder):
    recorder = FidelityRecorder(top_k=5)
    lm = KVTuneLM(
        str(tiny_llama_folder), AUTO, max_model_len=128, kl_tail_tokens=4, observer=recorder
    )
    context, continuation = words(12, 1), " " + words(3, 2)
    lm.loglikelihood([request("loglikelihood", context, continuation)])
    rows = recorder.rows[(context, continuation)]
    assert rows.num_tail == 4
    assert rows.top_ids.shape == (4 + 3, 5)
    assert torch.all(rows.top_logprobs[:, :-1] >= rows.top_logprobs[:, 1:])


def test_generate_until_cuts_at_the_stop_string(lm):
    context = words(10, 8)
    full = lm.generate_until([request("generate_until", context, {"max_gen_toks": 6})])[0]
    produced = full.split()
    assert 1 <= len(produced) <= 6
    stop = " " + produced[2] if len(produced) > 2 else produced[-1]
    [cut] = lm.generate_until(
        [request("generate_until", context, {"until": [stop], "max_gen_toks": 6})]
    )
    assert cut == full.split(stop)[0]


def test_simple_evaluate_runs_every_output_type(tmp_path, tiny_llama_folder):
    rows = [{"context": words(15, i), "answer": " " + words(2, 50 + i)} for i in range(3)]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
    common["test_split"] = "test"
    tasks = {
        "tiny_ll": {"output_type": "loglikelihood", "doc_to_text": "context"},
        "tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": ""},
        "tiny_generate": {
            "output_type": "generate_until",
            "doc_to_text": "context",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 3},
            "metric_list": [{"metric": "exact_match"}],
        },
    }
    for name, config in tasks.items():
        config = {"task": name, **common, "doc_to_target": "answer", **config}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
    lm = KVTuneLM(str(tiny_llama_folder), AUTO, max_model_len=64)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert 0 <= results["results"]["tiny_ll"]["acc,none"] <= 1
    assert results["results"]["tiny_rolling"]["word_perplexity,none"] > 1
    assert 0 <= results["results"]["tiny_generate"]["exact_match,none"] <= 1
    assert all(len(s["resps"]) == 1 for s in results["samples"]["tiny_ll"])
