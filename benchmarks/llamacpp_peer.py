"""llama.cpp beside kvtune on the same GGUF file: greedy answers to the suites' recall prompts and,
with --timing, the decode step.

Both engines read one embedded GGUF (--model: SmolLM2's Q4_1 file by default, or
Qwen2.5-Coder-0.5B's Q4_K_M; the file kvtune converts) and the same token ids: the suites'
greedy recall rows (passkey_greedy, multikey_greedy, codes_greedy; --docs haystacks of
--questions turns each, about --context tokens), encoded once by kvtune's tokenizer. llama.cpp
runs through llama-cpp-python 0.3.36 (its vendored llama.cpp 0c1e570, the version kvtune's
llamacpp presets reproduce; `bash scripts/llamacpp_extra.sh` builds it) with flash attention
on, --threads threads, and its cache types f16, q8_0 and q4_0; kvtune runs its torch runtime
(fp32 compute) with the matching presets (conf/policy/llamacpp/), plain fp16 (stored as
llamacpp/f16 stores) and --policy, kvtune's own format at q4_0's bytes (a row of
benchmarks.formats' equal-bytes table). Greedy, at most MAX_GEN_TOKENS tokens, stopping at the
tokenizer's EOS, cut at the suites' stop strings and compared as the suites compare (outer
whitespace and punctuation removed). A haystack's questions share its prefill in both engines:
kvtune as the suites do (shared_generation.greedy_generate), llama.cpp by keeping the prefix a
prompt shares with the previous one in its cache (as llama-server's prompt cache does).
Reported: how often the two engines' answers agree with f16 caches (their weights and kernels
differ, so this is the floor), the same under q8_0 and q4_0 (issue 42's target: q8_0 agreement
>= f16 agreement - 0.03), how often each engine's quantized answers equal its own f16 ones, and
each engine's exact match against the gold answers, with each cache's bytes against fp16's.
Answers are cached per (engine, cache, prompt) by content (the GGUF's SHA-256, the token ids,
the settings, this script's answering functions, and the kvtune runtime's source or the
llama.cpp libraries' bytes), so an interrupted run resumes.

--timing: the decode step at batch 1 after a prompt of each --contexts length (runtime_cpu's
random ids), kvtune's llamacpp presets and llama.cpp's three caches, each paired with kvtune's
fp16 step: --pairs runs of --steps steps, the first engine alternating (runtime_cpu's
paired_ratios); every pair's ratio (step over kvtune fp16's) is shown. What differs, so the
ratios are engine against engine, not cache against cache: llama.cpp multiplies by the Q4_1
weights (its CPU matmuls quantize the activations to q8_1), kvtune by the weights dequantized
to fp32 at load; llama.cpp's flash attention converts each query to its K type's dot-product
type (f16, or q8_0 for the quantized caches) and, with an f16 V, accumulates the output in fp16
(ggml-cpu/ops.cpp, flash_attn_ext one-chunk path), kvtune dequantizes the cache and computes in
fp32; llama.cpp is C++ with one graph a step, kvtune a Python engine over torch ops.

    bash scripts/llamacpp_extra.sh   # once: builds and installs llama-cpp-python
    .venv/bin/python -m benchmarks.llamacpp_peer [--model smollm2-135m] [--docs 2] [--questions 4]
        [--context 1024] [--policy "int4 K channel b64 / V g64 rotated"] [--markdown]
    .venv/bin/python -m benchmarks.llamacpp_peer --timing [--model smollm2-135m]
        [--contexts 512,2048] [--pairs 6] [--steps 8] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from tqdm import tqdm

from benchmarks.decoding import finish_running
from benchmarks.formats import POLICIES, bytes_ratio
from benchmarks.niah_heatmap import normalised
from benchmarks.runtime_cpu import kvtune_stepper, paired_ratios, prompts, ratio_cells
from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, code_key, default_cache_folder, key_digest
from kvtune.autotune.config.engine_presets import engine_presets
from kvtune.autotune.evaluation.shared_generation import cut_at_stops, greedy_generate
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import generate_rows
from kvtune.autotune.evaluation.tasks.greedy import MAX_GEN_TOKENS, STOP, TASKS
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.embedded_models import EMBEDDED_MODELS, embedded_gguf
from kvtune.runtime.fingerprint import file_digest
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
# kvtune's own format at q4_0's bytes (0.281 of fp16's on head_dim 64): the equal-bytes row of
# benchmarks.formats that beat every llama.cpp type on the quick suite.
EQUAL_BYTES_POLICY = "int4 K channel b64 / V g64 rotated"
CACHE_TYPES = ("f16", "q8_0", "q4_0")  # llama.cpp's --cache-type-k/-v names
FP16 = "fp16"
LLAMACPP = "llama.cpp"
KVTUNE = "kvtune"
# What decides a kvtune answer besides its inputs (the runtime converts the GGUF, too).
KVTUNE_CODE = ("kvtune.runtime", "kvtune.kernels", "kvtune.autotune.evaluation.shared_generation")
PREFILL_BATCH = 512  # llama.cpp's n_batch: prompt tokens a decode call takes
CONTEXT_PAD = 256  # llama.cpp pads its context to a multiple of this
# kvtune's caches as tables name them: fp16, and the preset matching each llama.cpp type.
KVTUNE_NAMES = {FP16: FP16} | {t: f"llamacpp/{t}" for t in CACHE_TYPES}


@dataclass(frozen=True)
class Prompt:
    """One recall question: its task, haystack (document index), token ids and gold answer."""

    task: str
    doc: int
    token_ids: list[int]
    answer: str


def recall_prompts(
    model: str, tokenizer: Tokenizer, docs: int, questions: int, context: int, seed: int
) -> list[Prompt]:
    """The suites' greedy recall rows (every greedy task, `docs` haystacks of `questions` turns
    at about `context` tokens), as token ids."""
    names = [task.name for task in TASKS]
    suite = EvalSuite.from_dict(
        {
            "name": "llamacpp-peer",
            "model": model,
            "seed": seed,
            "context_tokens": context,
            "tasks": {name: {"docs": docs, "questions": questions} for name in names},
        }
    )
    rows = generate_rows(suite, tokenizer)
    return [
        Prompt(name, row["doc"], tokenizer.encode(row["context"]), row["answer"])
        for name in names
        for row in rows[name]
    ]


def padded_context(tokens: int) -> int:
    """llama.cpp's n_ctx for `tokens`: rounded up to its multiple of CONTEXT_PAD."""
    return -(-tokens // CONTEXT_PAD) * CONTEXT_PAD


def answer_code() -> str:
    """SHA-256 prefix of the source of this script's functions that decide an answer (not of
    the whole script: its tables and timing can change without discarding answers). Read at
    import (ANSWER_CODE): inspect reads the file on disk, which may since have been edited."""
    functions = (open_llamacpp, llamacpp_next_token, llamacpp_greedy, llamacpp_generator)
    functions += (kvtune_generator, cached_outputs)
    source = "".join(inspect.getsource(function) for function in functions)
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def llamacpp_code() -> dict[str, str]:
    """What decides a llama.cpp answer: answer_code, llama-cpp-python's version and the bytes
    of the native libraries it loads (libllama, libggml*)."""
    import llama_cpp

    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("*.so*"))
    digest = hashlib.sha256("".join(f"{p.name}:{file_digest(p)}" for p in libs).encode())
    return {
        "script": ANSWER_CODE,
        "llama_cpp": llama_cpp.__version__,
        "libs": digest.hexdigest()[:16],
    }


def open_llamacpp(model: str, cache_type: str, n_ctx: int, threads: int) -> Any:
    """A llama.cpp context over `model`'s embedded GGUF with `cache_type` for K and V, flash
    attention on."""
    import llama_cpp

    ggml_type = getattr(llama_cpp, f"GGML_TYPE_{cache_type.upper()}")
    return llama_cpp.Llama(
        str(embedded_gguf(model)),
        n_ctx=n_ctx,
        n_batch=PREFILL_BATCH,
        n_ubatch=PREFILL_BATCH,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        type_k=ggml_type,
        type_v=ggml_type,
        verbose=False,
    )


def tokenization_differs(model: str, items: list[Prompt], tokenizer: Tokenizer) -> int:
    """Prompts whose text llama.cpp's tokenizer (from the GGUF) encodes to other ids than
    kvtune's: both engines are fed kvtune's ids, so this only says whether llama.cpp's own
    front end would have seen the same prompt."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(embedded_gguf(model)), vocab_only=True, verbose=False)
    try:
        return sum(
            vocab.tokenize(text.encode(), add_bos=False, special=True) != item.token_ids
            for item in items
            for text in [tokenizer.decode(item.token_ids, skip_special_tokens=False)]
        )
    finally:
        vocab.close()


def llamacpp_next_token(llm: Any) -> int:
    """Greedy: the argmax of the logits llama.cpp computed for its last evaluated token."""
    import llama_cpp

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))


def llamacpp_greedy(llm: Any, token_ids: Sequence[int], stop_ids: frozenset[int]) -> list[int]:
    """Greedy continuation of a prompt, at most MAX_GEN_TOKENS, ending at a stop id as kvtune's
    engine does (the stop id kept). The cache keeps what the prompt shares with the previous
    one (llama-server's prompt cache does the same), so a haystack's later questions prefill
    only their new turns, as kvtune's shared generation does."""
    previous = llm.input_ids[: llm.n_tokens].tolist()
    kept = next(
        (i for i, (a, b) in enumerate(zip(previous, token_ids, strict=False)) if a != b),
        min(len(previous), len(token_ids)),
    )
    llm.n_tokens = min(kept, len(token_ids) - 1)  # eval() drops the cache past n_tokens
    llm.eval(list(token_ids[llm.n_tokens :]))
    output: list[int] = []
    while len(output) < MAX_GEN_TOKENS:
        output.append(llamacpp_next_token(llm))
        if output[-1] in stop_ids:
            break
        llm.eval(output[-1:])
    return output


def llamacpp_stepper(llm: Any, prompt: list[int]) -> Callable[[int], float]:
    """Prefill the prompt in llama.cpp; the returned function times `steps` greedy decode steps
    (seconds): one llama_decode of one token and the argmax of its logits each, as kvtune's
    engine.step samples its token. One untimed step first, so that no run pays for setting
    up the one-token graph."""
    llm.reset()
    llm.eval(prompt)
    llm.eval([llamacpp_next_token(llm)])

    def timed(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            llm.eval([llamacpp_next_token(llm)])
        return time.perf_counter() - started

    return timed


def kvtune_policies(folder: Path, equal_bytes: str | None = None) -> dict[str, KVPolicy]:
    """kvtune's caches compared: the preset matching each llama.cpp type, plain fp16 (the same
    storage as llamacpp/f16: a check that the preset changes nothing else) and, when named,
    `equal_bytes`: a row of benchmarks.formats' POLICIES."""
    presets = engine_presets(arch_from_folder(folder).head_dim)
    policies = {t: presets[KVTUNE_NAMES[t]] for t in CACHE_TYPES} | {FP16: KVPolicy(FP16, FP16)}
    return policies | ({equal_bytes: POLICIES[equal_bytes]} if equal_bytes else {})


Generate = Callable[[list[list[int]]], list[list[int]]]


def cached_outputs(
    cache: JsonCache, key: dict[str, Any], items: list[Prompt], generate: Generate
) -> list[list[int]]:
    """Each prompt's generated ids, from the cache where this (engine, cache, prompt) ran; the
    prompts of a haystack missing there are generated together (they share its prefill)."""
    keys = [key | {"prompt": key_digest({"ids": item.token_ids})} for item in items]
    stored = [cache.get(k) for k in keys]
    haystacks = sorted({(i.task, i.doc) for i, s in zip(items, stored, strict=True) if s is None})
    for haystack in tqdm(haystacks, desc=f"{key['engine']} {key['cache']}", leave=False):
        group = [n for n, item in enumerate(items) if (item.task, item.doc) == haystack]
        started = time.perf_counter()
        outputs = generate([items[n].token_ids for n in group])
        seconds = (time.perf_counter() - started) / len(group)
        for n, ids in zip(group, outputs, strict=True):
            stored[n] = {"ids": ids, "seconds": seconds}
            cache.put(keys[n], stored[n])
    return [entry["ids"] for entry in stored]


def llamacpp_generator(
    model: str,
    cache_type: str,
    n_ctx: int,
    threads: int,
    stop_ids: frozenset[int],
    closing: ExitStack,
) -> Generate:
    """Greedy answers from a llama.cpp context opened at its first use (none when all are
    cached) and closed with `closing`."""
    opened: list[Any] = []

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        if not opened:
            opened.append(open_llamacpp(model, cache_type, n_ctx, threads))
            closing.callback(opened[0].close)
        return [llamacpp_greedy(opened[0], ids, stop_ids) for ids in prompts]

    return generate


def kvtune_generator(
    model: str, loaded: list[LLM], policy: KVPolicy, max_model_len: int
) -> Generate:
    """Greedy answers of kvtune's runtime under `policy`, a haystack's questions sharing its
    prefill as in the suites (shared_generation.greedy_generate): the model loaded at the first
    use into `loaded` (shared by every policy), its cache swapped for this policy's."""

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        if not loaded:
            loaded.append(LLM(model, policy, max_model_len=max_model_len, max_num_seqs=1))
        if loaded[0].policy != policy:
            loaded[0] = loaded[0].with_policy(policy)
        return greedy_generate(loaded[0], prompts, MAX_GEN_TOKENS, STOP).token_ids

    return generate


def engine_answers(
    model: str, items: list[Prompt], threads: int, policies: dict[str, KVPolicy], folder: Path
) -> dict[tuple[str, str], list[list[int]]]:
    """Generated ids of every prompt, per (engine, cache): llama.cpp's three cache types, then
    kvtune's `policies` (kvtune_policies)."""
    stop_ids = frozenset(Tokenizer.from_folder(folder).eos_token_ids)
    longest = max(len(item.token_ids) for item in items) + MAX_GEN_TOKENS
    cache = JsonCache(default_cache_folder("llamacpp_peer"))
    shared = {"gguf": EMBEDDED_MODELS[model].sha256, "max_new_tokens": MAX_GEN_TOKENS}
    shared["stop_ids"] = sorted(stop_ids)
    outputs = {}
    n_ctx = padded_context(longest)
    settings: dict[str, Any] = {"n_ctx": n_ctx, "n_batch": PREFILL_BATCH, "threads": threads}
    with ExitStack() as closing:
        for cache_type in CACHE_TYPES:
            key = shared | {"engine": LLAMACPP, "cache": cache_type, "settings": settings}
            key["code"] = llamacpp_code()
            generate = llamacpp_generator(model, cache_type, n_ctx, threads, stop_ids, closing)
            outputs[LLAMACPP, cache_type] = cached_outputs(cache, key, items, generate)
    loaded: list[LLM] = []
    for name, policy in policies.items():
        settings = {"policy": policy.to_dict(), "dtype": "fp32", "max_model_len": longest}
        key = shared | {"engine": KVTUNE, "cache": name, "settings": settings}
        key["code"] = code_key(*KVTUNE_CODE) | {"script": ANSWER_CODE}
        generate = kvtune_generator(model, loaded, policy, longest)
        outputs[KVTUNE, name] = cached_outputs(cache, key, items, generate)
    return outputs


ANSWER_CODE = answer_code()


def share(left: Sequence[str], right: Sequence[str]) -> float:
    """Share of positions where two answer lists agree."""
    return statistics.mean(a == b for a, b in zip(left, right, strict=True))


def counted(left: Sequence[str], right: Sequence[str]) -> str:
    """Share of agreeing positions, with the count it comes from."""
    agreeing = sum(a == b for a, b in zip(left, right, strict=True))
    return f"{agreeing / len(left):.2f} ({agreeing}/{len(left)})"


def report_answers(
    model: str,
    items: list[Prompt],
    answers: dict[tuple[str, str], list[str]],
    bytes_ratios: dict[str, float],
    markdown: bool,
) -> None:
    """Agreement between the engines per cache type (and minus the f16 agreement: issue 42's
    target), each engine's agreement with its own f16 answers, then exact match against the gold
    answers per task with each cache's bytes against fp16's (`bytes_ratios`, by kvtune's cache
    name; a llama.cpp type stores what its kvtune preset stores)."""
    console = Console()
    floor = share(answers[KVTUNE, "f16"], answers[LLAMACPP, "f16"])
    headers = ["kvtune", "llama.cpp", "answers agree", "minus f16 agreement", "kvtune = its f16"]
    headers.append("llama.cpp = its f16")
    lines = [
        [
            KVTUNE_NAMES[FP16],
            "f16",
            counted(answers[KVTUNE, FP16], answers[LLAMACPP, "f16"]),
            "",
            counted(answers[KVTUNE, FP16], answers[KVTUNE, "f16"]),
            "",
        ]
    ]
    for cache_type in CACHE_TYPES:
        ours, theirs = answers[KVTUNE, cache_type], answers[LLAMACPP, cache_type]
        agreement = share(ours, theirs)
        lines.append(
            [
                KVTUNE_NAMES[cache_type],
                cache_type,
                counted(ours, theirs),
                f"{agreement - floor:+.2f}" if cache_type != "f16" else "",
                counted(ours, answers[KVTUNE, "f16"]),
                counted(theirs, answers[LLAMACPP, "f16"]),
            ]
        )
    tasks = [task.name for task in TASKS]
    print(f"greedy answers of {len(items)} prompts ({', '.join(tasks)}), {model}")
    print_rows(headers, lines, markdown, console)
    gold = [normalised(item.answer) for item in items]
    exact = []
    for (engine, cache), texts in answers.items():
        by_task = [
            statistics.mean(
                t == g for t, g, i in zip(texts, gold, items, strict=True) if i.task == task
            )
            for task in tasks
        ]
        name = KVTUNE_NAMES.get(cache, cache) if engine == KVTUNE else cache
        exact.append(
            [engine, name, f"{bytes_ratios[cache]:.3f}", *(f"{v:.2f}" for v in by_task)]
            + [counted(texts, gold)]
        )
    print("exact match against the gold answers")
    print_rows(["engine", "cache", "bytes / fp16", *tasks, "all"], exact, markdown, console)
    columns = [f"{e} {KVTUNE_NAMES.get(c, c) if e == KVTUNE else c}" for e, c in answers]
    differing = [
        [item.task, str(item.doc), gold[n], *(texts[n] for texts in answers.values())]
        for n, item in enumerate(items)
        if len({texts[n] for texts in answers.values()}) > 1
    ]
    print("the prompts whose answers differ between any two runs")
    print_rows(["task", "haystack", "gold", *columns], differing, markdown, console)


def run_answers(args: argparse.Namespace) -> None:
    folder = resolve_model(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    items = recall_prompts(
        args.model, tokenizer, args.docs, args.questions, args.context, args.seed
    )
    lengths = [len(item.token_ids) for item in items]
    print(
        f"prompts: {len(items)}, {min(lengths)}-{max(lengths)} tokens; llama.cpp's own tokenizer "
        f"writes other ids for {tokenization_differs(args.model, items, tokenizer)} of them"
    )
    policies = kvtune_policies(folder, args.policy or None)
    outputs = engine_answers(args.model, items, args.threads, policies, folder)
    answers = {
        engine: [normalised(cut_at_stops(tokenizer.decode(ids), STOP)) for ids in generated]
        for engine, generated in outputs.items()
    }
    arch = arch_from_folder(folder)
    tokens = max(len(item.token_ids) for item in items)
    bytes_ratios = {name: bytes_ratio(arch, policy, tokens) for name, policy in policies.items()}
    report_answers(args.model, items, answers, bytes_ratios, args.markdown)


def run_timing(args: argparse.Namespace) -> None:
    """Decode step of each compared cache against kvtune's fp16 step, paired (module docstring)."""
    contexts = [int(c) for c in args.contexts.split(",")]
    total_steps = args.pairs * args.steps
    longest = max(contexts) + total_steps + 2
    folder = resolve_model(args.model)
    vocab = Tokenizer.from_folder(folder).vocab_size
    policies = kvtune_policies(folder)
    fp16 = LLM(args.model, policies[FP16], max_model_len=longest, max_num_seqs=1)
    quantized = {t: fp16.with_policy(policies[t]) for t in CACHE_TYPES if t != "f16"}
    headers = ["context", "engine", "cache", "ms/step", "kvtune fp16 ms/step", "ratio, mean"]
    headers += ["ratio, largest", "every pair"]
    lines = []
    with ExitStack() as closing:
        llamacpp = {
            t: open_llamacpp(args.model, t, padded_context(longest), args.threads)
            for t in CACHE_TYPES
        }
        for llm in llamacpp.values():
            closing.callback(llm.close)
        compared: list[tuple[str, str, Any]] = [
            (KVTUNE, KVTUNE_NAMES[t], llm) for t, llm in quantized.items()
        ] + [(LLAMACPP, t, llm) for t, llm in llamacpp.items()]
        for context in contexts:
            [prompt] = prompts(1, context, vocab)
            for engine, cache, llm in compared:
                reference = kvtune_stepper(fp16, [prompt], total_steps)
                if engine == KVTUNE:
                    stepper = kvtune_stepper(llm, [prompt], total_steps)
                else:
                    stepper = llamacpp_stepper(llm, prompt)
                runs = paired_ratios(stepper, reference, args.pairs, args.steps)
                for kvtune in (fp16, llm) if engine == KVTUNE else (fp16,):
                    finish_running(kvtune.engine)
                lines.append([str(context), engine, cache, *ratio_cells(runs)])
                print(" | ".join(lines[-1]), flush=True)
    print(
        f"decode step over kvtune's fp16 step, batch 1, {args.model}, {args.threads} threads "
        f"(kvtune: torch {torch.get_num_threads()}), {args.steps} steps a run, {args.pairs} pairs"
    )
    print_rows(headers, lines, args.markdown, Console())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(EMBEDDED_MODELS))
    parser.add_argument("--docs", type=int, default=2, help="haystacks of each greedy task")
    parser.add_argument("--questions", type=int, default=4, help="questions a haystack")
    parser.add_argument("--context", type=int, default=1024, help="tokens of a haystack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's n_threads")
    parser.add_argument(
        "--policy",
        default=EQUAL_BYTES_POLICY,
        choices=["", *POLICIES],
        help="kvtune's own format beside the presets (a benchmarks.formats row; '' for none)",
    )
    parser.add_argument("--timing", action="store_true", help="time decode steps instead")
    parser.add_argument("--contexts", default="512,2048", help="--timing: prompt lengths")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed a run")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        parser.error("llama_cpp is not installed: run `bash scripts/llamacpp_extra.sh` first")
    if args.timing:
        run_timing(args)
    else:
        run_answers(args)


if __name__ == "__main__":
    main()
