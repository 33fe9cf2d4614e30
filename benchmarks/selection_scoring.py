"""Which block-scoring rule finds the needle's block among hundreds: Quest key bounds over
whole blocks, bounds over smaller sub-blocks, the mean key, bounds rescored exactly, against
the exact scores.

For needle haystacks (the suite's generator: --task passkey or multikey, one row per question)
at each --contexts length, one exact fp32 forward of the prompt through the model (no cache, no
quantization) records each layer's queries at the last position (where the answer's first
token is predicted; with --through-answer, at every teacher-forced answer token as well, each
a pair of its own) and its post-RoPE keys. Every (layer, KV head) then ranks the older blocks
(outside --sinks and --window) by each rule, and the table gives the share of pairs whose
--topk holds every block with a digit of the answer:
- among all pairs; among the pairs that need it by mass (their exact attention, summed over
  the KV head's query heads, puts the answer's blocks in their own top --topk); and among the
  pairs that need it by logit (`exact max` holds them: the retrieval criterion);
- rules: `exact max` (the largest q.k over the block's keys and the head's queries: what an
  index without loss would rank by), `bounds /n` (Quest's upper bound of q.k from the
  per-channel max and min of keys, over n-token sub-blocks, block score the largest), `mean
  key` (q.mean of the block's post-RoPE keys: one vector a block, half the bounds' bytes) and
  `bounds, 2k rescored` and `4k rescored` (the 2 or 4 * topk best by bounds, reordered by
  exact max: what fetching those candidates' exact keys each step would give). A KV head
  scores a block by the largest over its query heads. Rows whose answer lies in the sinks or
  window are skipped.
It bounds what sharper scoring could give before any of it is built: the runtime's own choice
(quantized index) is `benchmarks.selection_recall`.

    .venv/bin/python -m benchmarks.selection_scoring [--model smollm2-135m] [--task passkey]
        [--contexts 3072,7168]
        [--docs 3] [--questions 1] [--seed 5] [--topk 80] [--block-size 16] [--sinks 16]
        [--window 256] [--through-answer]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from benchmarks.selection_recall import key_blocks, task_rows
from kvtune.runtime.model import DecoderModel, DenseCausalAttention
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.tokenizer import Tokenizer

# A rule maps queries [Hkv, g, D] and one layer's older keys [Hkv, blocks, block_size, D] to
# block scores [Hkv, blocks].
Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def exact_max(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hgd,hbtd->hgbt", queries, keys).amax(dim=(1, 3))


def bounds(sub_block: int) -> Rule:
    """Quest's upper bound of q.k from the per-channel max and min of keys over sub-blocks of
    `sub_block` keys; a block scores its largest sub-block."""

    def score(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        heads, blocks, size, dim = keys.shape
        subs = keys.view(heads, blocks, size // sub_block, sub_block, dim)
        hi, lo = subs.amax(dim=3), subs.amin(dim=3)
        upper = torch.einsum("hgd,hbsd->hgbs", queries.clamp(min=0), hi)
        upper += torch.einsum("hgd,hbsd->hgbs", queries.clamp(max=0), lo)
        return upper.amax(dim=(1, 3))

    return score


def mean_key(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hgd,hbd->hgb", queries, keys.mean(dim=2)).amax(dim=1)


def rescored(topk: int, factor: int) -> Rule:
    """The factor * topk best blocks by whole-block bounds, reordered by exact max (the others
    below every candidate)."""

    def score(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        by_bounds = bounds(keys.shape[2])(queries, keys)
        candidates = by_bounds.topk(min(factor * topk, by_bounds.shape[-1]), dim=-1).indices
        exact = exact_max(queries, keys).gather(-1, candidates)
        return torch.full_like(by_bounds, -math.inf).scatter(-1, candidates, exact)

    return score


def exact_mass(queries: torch.Tensor, keys: torch.Tensor, all_keys: torch.Tensor) -> torch.Tensor:
    """[Hkv, blocks]: attention the KV head's query heads give each older block, normalised
    over every key the query sees (`all_keys` [Hkv, T, D])."""
    scale = queries.shape[-1] ** -0.5
    norm = torch.logsumexp(torch.einsum("hgd,htd->hgt", queries, all_keys) * scale, dim=-1)
    logits = torch.einsum("hgd,hbtd->hgbt", queries, keys) * scale
    return (logits - norm[:, :, None, None]).exp().sum(dim=(1, 3))


def holds(scores: torch.Tensor, key: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [Hkv]: whether each KV head's top `topk` blocks by `scores` hold all of `key`."""
    top = scores.topk(topk, dim=-1).indices
    return torch.stack([torch.isin(key, head_top).all() for head_top in top])


class RecordingAttention(DenseCausalAttention):
    """Exact attention that keeps each layer's last `last` queries ([last, Hq, D]) and all keys
    (post-RoPE, fp32)."""

    def __init__(self, seq_len: int, last: int = 1) -> None:
        super().__init__([seq_len])
        self.last = last
        self.last_queries: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []

    def __call__(self, layer_index, q, k, v):
        self.last_queries.append(q[-self.last :].float())
        self.keys.append(k.float())
        return super().__call__(layer_index, q, k, v)


def rules(topk: int) -> dict[str, Rule]:
    return {
        "exact max": exact_max,
        "bounds /16": bounds(16),
        "bounds /8": bounds(8),
        "bounds /4": bounds(4),
        "mean key": mean_key,
        "bounds, 2k rescored": rescored(topk, 2),
        "bounds, 4k rescored": rescored(topk, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model preset or folder")
    parser.add_argument("--task", default="passkey", choices=["passkey", "multikey"])
    parser.add_argument("--contexts", default="3072,7168")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--questions", type=int, default=1, help="a document (multikey)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--topk", type=int, default=80)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument(
        "--through-answer",
        action="store_true",
        help="score at every teacher-forced answer token, not only where the answer starts",
    )
    args = parser.parse_args()
    folder = resolve_model(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    model = DecoderModel.from_checkpoint(folder, dtype="fp32")
    num_kv_heads = model.config.num_kv_heads
    names = list(rules(args.topk))
    cells = " | ".join(f"{name}: all / by mass / by logit" for name in names)
    print(f"| context | answer depth | pairs that need its blocks: by mass / by logit | {cells} |")
    print("|---|---|---|" + "---|" * len(names))
    for context in [int(c) for c in args.contexts.split(",")]:
        for row in task_rows(args.task, context, args.docs, args.seed, tokenizer, args.questions):
            prompt = tokenizer.encode(row["context"])
            answer = tokenizer.encode(row["context"] + row["answer"])[len(prompt) :]
            scored = len(answer) if args.through_answer else 1
            ids = torch.tensor(prompt + answer[: scored - 1])
            blocks = key_blocks(
                row["context"], row["answer"], tokenizer, args.sinks, args.block_size
            )
            older = (len(prompt) - args.window - args.sinks) // args.block_size
            if blocks.start < 0 or blocks.stop > older:
                continue
            key = torch.tensor(list(blocks))
            attention = RecordingAttention(len(ids), scored)
            with torch.inference_mode():
                model(ids, torch.arange(len(ids)), attention)
            topk = min(args.topk, older)
            hits = {name: [] for name in names}
            by_mass = []
            for last_queries, keys in zip(attention.last_queries, attention.keys, strict=True):
                all_keys = keys.transpose(0, 1)  # [Hkv, T, D]
                span = all_keys[:, args.sinks : args.sinks + older * args.block_size]
                block_keys = span.reshape(num_kv_heads, older, args.block_size, -1)
                for offset, q_last in enumerate(last_queries):
                    queries = q_last.view(num_kv_heads, -1, q_last.shape[-1])
                    seen = all_keys[:, : len(prompt) + offset]  # causal: keys up to the query
                    by_mass.append(holds(exact_mass(queries, block_keys, seen), key, topk))
                    for name, rule in rules(topk).items():
                        hits[name].append(holds(rule(queries, block_keys), key, topk))
            mass_need = torch.stack(by_mass).flatten()
            logit_need = torch.stack(hits["exact max"]).flatten()
            shares = []
            for name in names:
                hit = torch.stack(hits[name]).flatten().float()
                parts = [hit.mean(), hit[mass_need].mean(), hit[logit_need].mean()]
                shares.append(" / ".join(f"{part:.2f}" for part in parts))
            print(
                f"| {context} | {row['depth']:.2f} | {int(mass_need.sum())} / "
                f"{int(logit_need.sum())} of {mass_need.numel()} | " + " | ".join(shares) + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
