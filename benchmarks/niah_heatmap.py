"""Needle in a haystack: greedy pass-key exact match by depth and context length, fp16 beside a
policy, as a heatmap.

For each --contexts length, --docs haystacks of the suites' `passkey_greedy` task (its own
generator: --depths doors a haystack, each pass key at its own depth, the depths of all
haystacks tiling [0, 1]) are answered by greedy generation through the policy's cache, the
questions of one haystack sharing its prefill as in the suites, and scored as the suites score
them (exact match, punctuation and outer whitespace ignored). A cell is the share of keys in
its depth band answered exactly (--docs keys a cell). Each (context, policy) is cached by
content (the model's files, the rows, the policy, the code and compute path), so an
interrupted run resumes where it stopped. Writes the PNG (--out) and prints the table.

    .venv/bin/python -m benchmarks.niah_heatmap [--model qwen2.5-coder-0.5b]
        [--contexts 2048,4096,8192,16384] [--docs 2] [--depths 5]
        [--policy "<a benchmarks.compression policy>" ...] [--out benchmarks/figures/niah.png]
        [--markdown]
"""

from __future__ import annotations

import argparse
import re
import string
import textwrap
import time
from pathlib import Path

import matplotlib
from rich.console import Console

from benchmarks.compression import POLICIES
from benchmarks.formats import bytes_ratio
from benchmarks.tables import print_rows
from kvtune.autotune.cache import JsonCache, code_key, default_cache_folder, key_digest
from kvtune.autotune.evaluation.lm_backend import KVTuneLM
from kvtune.autotune.evaluation.shared_generation import cut_at_stops, greedy_generate
from kvtune.autotune.evaluation.suite import EvalSuite
from kvtune.autotune.evaluation.task_files import generate_rows
from kvtune.autotune.evaluation.tasks.greedy import MAX_GEN_TOKENS, STOP
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer

TASK = "passkey_greedy"
FP16 = "fp16"
DEFAULT_POLICY = "int4 K channel / V rotated w256 + top80 host no summaries int4 index"
CODE = (
    "benchmarks.niah_heatmap",
    "kvtune.autotune.evaluation.shared_generation",
    "kvtune.autotune.evaluation.lm_backend",
    "kvtune.autotune.evaluation.tasks",  # the stops and token budget of the answers
    "kvtune.runtime",
    "kvtune.kernels",
)


def needle_rows(model: str, context: int, docs: int, depths: int, seed: int) -> list[dict]:
    """The passkey_greedy rows (prompt text, answer, depth) of `docs` haystacks."""
    suite = EvalSuite.from_dict(
        {
            "name": f"niah-{context}",
            "model": model,
            "seed": seed,
            "context_tokens": context,
            "tasks": {TASK: {"docs": docs, "questions": depths}},
        }
    )
    return generate_rows(suite, Tokenizer.from_folder(resolve_model(model)))[TASK]


def normalised(text: str) -> str:
    """What the suites compare (task_files.GENERATION_METRICS): outer whitespace and
    punctuation removed."""
    text = re.sub(r"^\s+|\s+$", "", text)
    return text.translate(str.maketrans("", "", string.punctuation))


def answered(model: str, policy: KVPolicy, rows: list[dict], hosts: int) -> list[bool]:
    """Whether greedy generation through the policy's cache writes each row's key (hosts: the
    haystacks, prefilled together)."""
    tokenizer = Tokenizer.from_folder(resolve_model(model))
    longest = max(len(tokenizer.encode(row["context"])) for row in rows) + 1  # a BOS at most
    lm = KVTuneLM(model, policy, max_num_seqs=hosts, max_model_len=longest + MAX_GEN_TOKENS)
    prompts = [lm.tok_encode(row["context"]) for row in rows]
    outputs = greedy_generate(lm.llm, prompts, MAX_GEN_TOKENS, STOP).token_ids
    texts = [cut_at_stops(lm.tok_decode(tokens), STOP) for tokens in outputs]
    return [normalised(t) == normalised(row["answer"]) for t, row in zip(texts, rows, strict=True)]


def cached_answers(
    model: str, policy: KVPolicy, rows: list[dict], hosts: int, cache: JsonCache
) -> tuple[list[bool], float]:
    """answered(), from the content-keyed cache when it already ran; (hits, seconds it took)."""
    key = {
        "model": model_fingerprint(resolve_model(model)),
        "rows": key_digest({"rows": rows}),
        "policy": policy.to_dict(),
        "code": code_key(*CODE),
    }
    stored = cache.get(key)
    if stored is None:
        started = time.perf_counter()
        hits = answered(model, policy, rows, hosts)
        stored = {"hits": hits, "seconds": time.perf_counter() - started}
        cache.put(key, stored)
    return stored["hits"], stored["seconds"]


def band_shares(rows: list[dict], hits: list[bool], depths: int) -> list[float]:
    """Exact-match share in each of `depths` equal depth bands."""
    totals, correct = [0] * depths, [0] * depths
    for row, hit in zip(rows, hits, strict=True):
        band = min(int(row["depth"] * depths), depths - 1)
        totals[band] += 1
        correct[band] += hit
    return [c / t if t else float("nan") for c, t in zip(correct, totals, strict=True)]


def draw(grids: dict[str, list[list[float]]], contexts: list[int], depths: int, out: Path) -> None:
    """One heatmap per policy, side by side: depth down, context across, share in the cell."""
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(grids), figsize=(3.6 * len(grids) + 1, 3.8), squeeze=False, sharey=True
    )
    axes[0][0].set_ylabel("needle depth")
    for axis, (name, grid) in zip(axes[0], grids.items(), strict=True):
        by_band = [list(band) for band in zip(*grid, strict=True)]  # [depth band][context]
        image = axis.imshow(by_band, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        axis.set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
        axis.set_yticks(range(depths), [f"{(b + 0.5) / depths:.0%}" for b in range(depths)])
        axis.set_xlabel("context (tokens)")
        axis.set_title(textwrap.fill(name, 40), fontsize=8)
        for band, shares in enumerate(by_band):
            for column, share in enumerate(shares):
                axis.text(column, band, f"{share:.1f}", ha="center", va="center", fontsize=7)
    figure.colorbar(image, ax=axes[0].tolist(), label="greedy exact match")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--contexts", default="2048,4096,8192,16384")
    parser.add_argument("--docs", type=int, default=2, help="haystacks a context (keys a cell)")
    parser.add_argument("--depths", type=int, default=5, help="depth bands (doors a haystack)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--policy", action="append", help=f"repeatable; default: {DEFAULT_POLICY!r}"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures/niah.png"))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    names = args.policy or [DEFAULT_POLICY]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        parser.error(f"--policy: unknown {unknown}; known: {', '.join(POLICIES)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    policies = {FP16: KVPolicy("fp16", "fp16"), **{name: POLICIES[name] for name in names}}
    cache = JsonCache(default_cache_folder("niah"))
    grids: dict[str, list[list[float]]] = {name: [] for name in policies}
    lines = []
    arch = arch_from_folder(resolve_model(args.model))
    for context in contexts:
        rows = needle_rows(args.model, context, args.docs, args.depths, args.seed)
        for name, policy in policies.items():
            hits, seconds = cached_answers(args.model, policy, rows, args.docs, cache)
            shares = band_shares(rows, hits, args.depths)
            grids[name].append(shares)
            lines.append(
                [str(context), name, f"{bytes_ratio(arch, policy, context):.3f}"]
                + [*(f"{s:.2f}" for s in shares), f"{sum(hits)}/{len(hits)}", f"{seconds:.0f}"]
            )
            print(" | ".join(lines[-1]), flush=True)
    headers = ["context", "policy", "device bytes / fp16"]
    headers += [f"depth {(b + 0.5) / args.depths:.0%}" for b in range(args.depths)]
    headers += ["keys answered", "seconds"]
    print_rows(headers, lines, args.markdown, Console())
    draw(grids, contexts, args.depths, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
