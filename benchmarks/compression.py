"""CSA compression on the accuracy suites: today's pooling, summaries pooled as if before RoPE,
and query-aware selection over a host tier, with their bytes, fetches and decode speed.

Issue 13's table: device bytes and host-tier bytes relative to fp16 at the trial suite's
context, retention on the trial suite and on held-out seeds, greedy exact match on passkey and
multikey (absolute, fp16's beside), greedy generation of the pass key in a --needle-context
haystack (passkey_greedy: what a user sees, at 16x a 256-token window by default), the bytes a
decode step fetches from the host tier, and the decode step time relative to fp16 measured in
the same run, fp16's and the row's steps taken in turns (--decode-batch sequences of
--decode-context tokens each decoding together, 1 by default; on the torch path on the CPU by
default, or on --backend and --device, e.g. triton on cuda, where the host tier is pinned host
memory and fetches are real copies; the accuracy suites run as their presets say).
Accuracy results are cached like the validity benchmark's (content-keyed), so a rerun only
re-times decode; --decode-only skips them (bytes, fetches and timing alone).

    .venv/bin/python -m benchmarks.compression [--cheap quick] [--heldout heldout]
        [--heldout-seeds 1] [--policies "..."] [--decode-context 4096] [--needle-context 4096]
        [--needle-docs 8] [--decode-batch 1] [--threads 0] [--backend torch] [--device cpu]
        [--decode-only] [--markdown]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from benchmarks.decoding import finish_running, paired_medians, random_prompts, start_decoding
from benchmarks.eval_validity import cached_evaluate, fmt, mean_result, with_seed
from benchmarks.formats import FP16, bytes_ratio
from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.evaluation import EvalSuite, load_suite
from kvtune.runtime import LLM
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.backends import BACKENDS
from kvtune.runtime.kv_bytes import host_kv_bytes_per_sequence, kv_bytes_per_sequence
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy

FP8 = KVPolicy("fp8", "fp8")
INT4 = KVPolicy("int4", "int4", rotation="hadamard")
# 0.41 of fp16's bytes: near-lossless 8-bit keys (per-token codes need 8 bits on this model's
# keys), 4-bit rotated values; cheap enough that more blocks fit the staging pool.
K8V4 = KVPolicy("int8", "int4", group_size=64, rotation="hadamard")
# 4-bit: per-channel int4 keys (one scale and zero point per channel per block), rotated int4
# values in groups of 64; beside selection only with key bounds in their own index.
INT4_CHANNEL = KVPolicy("int4", "int4", group_size=64, k_scale_axis="channel", rotation="hadamard")


# SmolLM2's 30 layers: 80 blocks a query in layers 14-24, 24 in the others.
RETRIEVAL_BAND = (24,) * 14 + (80,) * 11 + (24,) * 5
# 80 blocks where the exact model puts the most attention on older blocks when an answer is
# due, the other layers in proportion, at least 16: `python -m benchmarks.layer_budgets`.
# fmt: off
OLDER_MASS_BUDGETS = (
    74, 50, 78, 79, 75, 79, 73, 80, 79, 73, 57, 29, 16, 16, 34,
    27, 16, 20, 48, 18, 53, 65, 41, 64, 22, 16, 23, 16, 24, 24,
)
# fmt: on
# The same with at least 48 blocks a layer (`--floor 48`): 0.73 of the uniform 80's blocks.
OLDER_MASS_BUDGETS_48 = tuple(max(48, budget) for budget in OLDER_MASS_BUDGETS)


def _csa(base: KVPolicy, ratio: int, window: int, **changes) -> KVPolicy:
    return base.replace(csa_ratio=ratio, csa_window=window, csa_sinks=16, **changes)


def _int4_host(
    window: int, topk: int, index: str = "bounds", staging: str = "resident", rescore: int = 1
) -> KVPolicy:
    """4-bit keys and values with selection from the host tier and no summaries, the index in
    int4 in the model's basis (rescore > 1: two-stage, the host tier's keys decide)."""
    return _csa(
        INT4_CHANNEL,
        2,
        window,
        csa_topk=topk,
        csa_host=True,
        csa_summary="none",
        csa_index=index,
        csa_index_dtype="int4",
        csa_staging=staging,
        csa_rescore=rescore,
    )


POLICIES: dict[str, KVPolicy] = {
    "fp16": FP16,
    "fp8": FP8,
    # Pooling only (no host tier), at equal bytes: the summaries before and after the fix.
    "fp8 csa8 w256 post-RoPE (before)": _csa(FP8, 8, 256, csa_summary="post_rope"),
    "fp8 csa8 w256 pre-RoPE": _csa(FP8, 8, 256),
    # Pooling at the bytes of the importance-kept rows below (today's pooling, denser).
    "fp8 csa4 w256": _csa(FP8, 4, 256),
    "fp8 csa2 w256": _csa(FP8, 2, 256),
    # No host tier: csa_keep of each 8 older blocks kept exact by window attention received,
    # beside summaries of all (csa8 + 1/8 kept = csa4's bytes; csa8 + 3/8 = csa2's).
    "fp8 csa8 w256 keep 1/8": _csa(FP8, 8, 256, csa_keep=0.125),
    "fp8 csa16 w256 keep 1/8": _csa(FP8, 16, 256, csa_keep=0.125),
    "fp8 csa8 w256 keep 3/8": _csa(FP8, 8, 256, csa_keep=0.375),
    # Query-aware selection over the host tier, scored on key bounds or on summaries.
    "fp8 csa16 w256 + top32 host": _csa(FP8, 16, 256, csa_topk=32, csa_host=True),
    "fp8 csa16 w256 + top32 host (summary index)": _csa(
        FP8, 16, 256, csa_topk=32, csa_host=True, csa_index="summaries"
    ),
    "fp8 csa16 w256 + top48 host": _csa(FP8, 16, 256, csa_topk=48, csa_host=True),
    # Twice the blocks, with and without summaries: what the greedy needle needs.
    "fp8 csa16 w256 + top96 host": _csa(FP8, 16, 256, csa_topk=96, csa_host=True),
    "fp8 w256 + top96 host no summaries": _csa(
        FP8, 2, 256, csa_topk=96, csa_host=True, csa_summary="none"
    ),
    # The same with Hadamard-rotated keys and values: do rotated key bounds select worse?
    "fp8 rotated w256 + top96 host no summaries": _csa(
        FP8.replace(rotation="hadamard"), 2, 256, csa_topk=96, csa_host=True, csa_summary="none"
    ),
    "int4 rotated csa16 w128 + top32 host": _csa(INT4, 16, 128, csa_topk=32, csa_host=True),
    # Without summaries (Quest): an older block a query does not select is not read; the
    # summary slots go to selected blocks.
    "fp8 w256 + top48 host no summaries": _csa(
        FP8, 2, 256, csa_topk=48, csa_host=True, csa_summary="none"
    ),
    "fp8 w256 + top56 host no summaries": _csa(
        FP8, 2, 256, csa_topk=56, csa_host=True, csa_summary="none"
    ),
    "K int8 / V int4 rotated w256 + top80 host no summaries": _csa(
        K8V4, 2, 256, csa_topk=80, csa_host=True, csa_summary="none"
    ),
    # The top-k at which the greedy needle matched fp16's with summaries (fp8 csa16 w256).
    "K int8 / V int4 rotated w256 + top96 host no summaries": _csa(
        K8V4, 2, 256, csa_topk=96, csa_host=True, csa_summary="none"
    ),
    # The staging pool of a window of 128: 16 more blocks a query than at 256 for the same bytes.
    "K int8 / V int4 rotated w128 + top96 host no summaries": _csa(
        K8V4, 2, 128, csa_topk=96, csa_host=True, csa_summary="none"
    ),
    # 4-bit with the host tier, about 0.10 of fp16's device bytes at 3K tokens (bounds in an
    # int4 index in the model's basis): 784 tokens a query read exactly, by two block sizes.
    "int4 K channel / V rotated w128 + top40 host no summaries int4 index": _int4_host(128, 40),
    "int4 K channel b32 / V rotated w128 + top20 host no summaries int4 index": _csa(
        INT4_CHANNEL.replace(block_size=32),
        2,
        128,
        csa_topk=20,
        csa_host=True,
        csa_summary="none",
        csa_index_dtype="int4",
    ),
    # K int8 / V int4's 256-token window and 80 blocks a query, at 4-bit.
    "int4 K channel / V rotated w256 + top80 host no summaries int4 index": _int4_host(256, 80),
    # The same choice reused for 2 and 4 positions (LServe's reusable page selector): decode
    # scores and fetches at one step in N and where a block leaves the window.
    **{
        f"int4 K channel / V rotated w256 + top80 host no summaries int4 index select every {n}": (
            _int4_host(256, 80).replace(csa_select_every=n)
        )
        for n in (2, 4)
    },
    # Reuse for 4 positions only outside layers 14-24, where selection most often reads a pass
    # key's block (RETRIEVAL_BAND): those layers choose at every query.
    "int4 K channel / V rotated w256 + top80 host no summaries int4 index select every 4 "
    "outside layers 14-24": _int4_host(256, 80).replace(
        layer_csa_select_every=tuple(1 if budget == 80 else 4 for budget in RETRIEVAL_BAND)
    ),
    # The same selections with one staging pool the layers fill in turn (ShadowKV, InfiniGen):
    # the staging bytes of one layer, not 30; every layer's choice is fetched every step.
    "int4 K channel / V rotated w256 + top80 streamed no summaries int4 index": _int4_host(
        256, 80, staging="streamed"
    ),
    "int4 K channel / V rotated w128 + top40 streamed no summaries int4 index": _int4_host(
        128, 40, staging="streamed"
    ),
    # Per-layer budgets (PyramidKV-style): the full 80 blocks only in layers 14-24, where
    # selection most often reads a pass key's block (benchmarks.selection_recall), 24 in the
    # others: 0.56 of the uniform budget's blocks fetched and attended, the same staging pool.
    "int4 K channel / V rotated w256 + top80 in layers 14-24 / top24 elsewhere host no "
    "summaries int4 index": _int4_host(256, 80).replace(layer_csa_topk=RETRIEVAL_BAND),
    # The same blocks in every layer at about the same total (0.60 of 80).
    "int4 K channel / V rotated w256 + top48 host no summaries int4 index": _int4_host(256, 48),
    # Budgets read off the model instead (0.57 of the uniform 80's blocks): most in layers 0-10.
    "int4 K channel / V rotated w256 + top16-80 by older attention host no summaries int4 "
    "index": _int4_host(256, 80).replace(layer_csa_topk=OLDER_MASS_BUDGETS),
    "int4 K channel / V rotated w256 + top48-80 by older attention host no summaries int4 "
    "index": _int4_host(256, 80).replace(layer_csa_topk=OLDER_MASS_BUDGETS_48),
    # The same scored on mean keys (one K vector a block in the int4 index, half the bounds'
    # bytes), which rank blocks by the attention mass they draw better than bounds do
    # (benchmarks.selection_scoring); and the 0.10-of-fp16 budget scored alike.
    "int4 K channel / V rotated w256 + top80 host no summaries int4 means": _int4_host(
        256, 80, "means"
    ),
    "int4 K channel / V rotated w128 + top40 host no summaries int4 means": _int4_host(
        128, 40, "means"
    ),
    # Does an index in the model's basis find more needles than bounds in the rotated pools?
    "K int8 / V int4 rotated w256 + top80 host no summaries fp8 index": _csa(
        K8V4, 2, 256, csa_topk=80, csa_host=True, csa_summary="none", csa_index_dtype="fp8"
    ),
    # Two-stage selection (issue 39 item 3): the index shortlists 4 x the budget, the host
    # tier's keys decide; resident, and streamed at the long-context byte targets (0.032 of
    # fp16's device bytes at 8K, 0.026 at 16K on Qwen2.5-Coder-0.5B).
    **{
        f"int4 K channel / V rotated w256 + top80 {tier} no summaries int4 index rescored x4": (
            _int4_host(256, 80, staging=staging, rescore=4)
        )
        for tier, staging in (("host", "resident"), ("streamed", "streamed"))
    },
    # What limits the selecting rows at long context: the 4-bit cache alone, and selection
    # alone over an fp16 cache (its bounds in the fp16 pools).
    "int4 K channel / V rotated": INT4_CHANNEL,
    "fp16 w256 + top80 host no summaries": _csa(
        FP16, 2, 256, csa_topk=80, csa_host=True, csa_summary="none"
    ),
    "K int8 / V int4 g64 rotated": K8V4,
    "K int8 / V int4 rotated csa16 w256 + top64 host": _csa(
        K8V4, 16, 256, csa_topk=64, csa_host=True
    ),
    "K int8 / V int4 rotated csa16 w256 + top72 host": _csa(
        K8V4, 16, 256, csa_topk=72, csa_host=True
    ),
}


def needle_suite(base: EvalSuite, context: int, docs: int) -> EvalSuite:
    """The trial suite's model and settings, with only the greedy pass-key task at `context`."""
    data = {**base.to_dict(), "name": f"needle-{context}", "context_tokens": context}
    data["tasks"] = {"passkey_greedy": {"docs": docs}}
    return load_suite(data)


# Tokens each timed sequence may generate: enough to keep the first prompts decoding while the
# later ones prefill; the timed sequences are finished once the timed steps are taken.
DECODE_HEADROOM = 512


def decode_timing(
    base: LLM, llm: LLM, context: int, steps: int, batch: int = 1
) -> tuple[float, float, float]:
    """(median seconds of an fp16 decode step, of the policy's, host-tier bytes the policy
    fetches per sequence and step) over `steps` steps of `batch` sequences decoding together,
    each after its own `context`-token prompt, the same prompts in both engines. The two
    engines step in turns, so that a shared machine's load drifts into both medians alike."""
    engines = [base.engine, llm.engine]
    prompts = random_prompts(context, batch)
    for engine in engines:
        start_decoding(engine, prompts, DECODE_HEADROOM)
    before = llm.engine.stats()["kv_fetched_bytes"]
    fp16_step, step = paired_medians(engines, steps)
    fetched = llm.engine.stats()["kv_fetched_bytes"] - before
    for engine in engines:
        finish_running(engine)
    return fp16_step, step, fetched / steps / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cheap", default="quick")
    parser.add_argument("--heldout", default="heldout")
    parser.add_argument("--heldout-seeds", default="1", help="comma-separated ('' = none)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names")
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--needle-context", type=int, default=4096)
    parser.add_argument("--needle-docs", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument(
        "--decode-batch", type=int, default=1, help="sequences decoding together when timed"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default); the whole run, fp16 included",
    )
    parser.add_argument("--backend", default="torch", choices=sorted(BACKENDS))
    parser.add_argument("--device", default="cpu", help="where decode is timed")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument(
        "--decode-only", action="store_true", help="bytes and decode timing, no accuracy suites"
    )
    args = parser.parse_args()
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    if args.threads < 0:
        parser.error(f"--threads: {args.threads}; allowed: 0 (torch's default) or a positive count")
    if args.decode_batch < 1:
        parser.error(f"--decode-batch: {args.decode_batch}; allowed: a positive count")
    if args.threads:
        torch.set_num_threads(args.threads)
    cheap = load_suite(args.cheap)
    seeds = [int(s) for s in args.heldout_seeds.split(",") if s.strip()]
    heldouts = [with_seed(load_suite(args.heldout), seed) for seed in seeds]
    needle = needle_suite(cheap, args.needle_context, args.needle_docs)
    # Bytes at the trial suite's context and at the held-out one's (longer: CSA saves more).
    contexts = [cheap.context_tokens, *[suite.context_tokens for suite in heldouts[:1]]]
    folder = resolve_model(cheap.model)
    arch = arch_from_folder(folder)
    console = Console()
    cache = JsonCache(default_cache_folder("eval-validity"))
    length = args.decode_context + DECODE_HEADROOM + 8
    base = LLM(
        folder,
        policy=FP16,
        backend=args.backend,
        device=args.device,
        max_model_len=length,
        max_num_seqs=args.decode_batch,
    )
    rows = []
    for name in names:
        policy = POLICIES[name]
        quick = held = greedy = None
        if not args.decode_only:
            quick = cached_evaluate(policy, cheap, cache)
            held = (
                mean_result([cached_evaluate(policy, s, cache) for s in heldouts])
                if seeds
                else None
            )
            greedy = cached_evaluate(policy, needle, cache)["tasks"]["passkey_greedy"]
        # fp16 timed beside each row: a shared machine's load drifts over a long run.
        fp16_step, step, fetched = decode_timing(
            base,
            base.with_policy(policy),
            args.decode_context,
            args.decode_steps,
            args.decode_batch,
        )
        device = " / ".join(f"{bytes_ratio(arch, policy, t):.3f}" for t in contexts)
        host = " / ".join(
            f"{host_kv_bytes_per_sequence(arch, policy, t) / fp16_bytes:.3f}"
            for t in contexts
            for fp16_bytes in [kv_bytes_per_sequence(arch, FP16, t)]
        )
        rows.append(
            (
                name,
                device,
                host,
                quick,
                held,
                greedy,
                fetched,
                step / fp16_step,
            )
        )
        # The absolute steps show the machine's state: a CPU whose fp16 step is fast runs the
        # policy's many small calls relatively slower (benchmarks/RESULTS.md, "CSA pooling and
        # selection": the decode tables).
        console.log(
            f"{name}: {device} device, {step / fp16_step:.2f}x fp16's decode step "
            f"({step * 1000:.1f} / {fp16_step * 1000:.1f} ms)"
        )
    decode_at = f"{args.decode_context}" + (
        f" x{args.decode_batch}" if args.decode_batch > 1 else ""
    )
    if (args.backend, args.device) != ("torch", "cpu"):
        decode_at += f" ({args.backend}, {args.device})"
    print_table(rows, cheap.name, contexts, decode_at, args.markdown, console)


def _retention(result: dict | None) -> str:
    if result is None:
        return "-"
    return f"{fmt(result['accuracy_retention'])} ± {fmt(result['accuracy_retention_stderr'])}"


def _exact(result: dict | None, task: str) -> str:
    row = None if result is None else result["tasks"].get(task)
    return (
        "-"
        if row is None
        else f"{fmt(row['exact_match'], 2)} ({fmt(row['baseline_exact_match'], 2)})"
    )


def print_table(
    rows: list, cheap: str, contexts: list[int], context: str, markdown: bool, console: Console
) -> None:
    at = " / ".join(f"@{t}" for t in contexts)
    headers = [
        "policy",
        f"device bytes / fp16 {at}",
        f"host bytes / fp16 {at}",
        f"{cheap} retention",
        "held-out retention",
        "passkey exact (fp16)",
        "multikey exact (fp16)",
        "greedy needle exact (fp16)",
        f"KiB fetched / sequence / decode step @{context}",
        f"decode step / fp16 @{context}",
    ]
    lines = []
    for name, device, host, quick, held, greedy, fetched, speed in rows:
        shown = held or quick
        lines.append(
            [
                name,
                device,
                host,
                _retention(quick),
                _retention(held),
                _exact(shown, "passkey"),
                _exact(shown, "multikey"),
                f"{fmt(greedy['exact_match'], 2)} ({fmt(greedy['baseline_exact_match'], 2)})"
                if greedy
                else "-",
                f"{fetched / 1024:.0f}",
                f"{speed:.2f}",
            ]
        )
    print_rows(headers, lines, markdown, console)


if __name__ == "__main__":
    main()
