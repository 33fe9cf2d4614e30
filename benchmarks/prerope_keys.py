"""Per-channel integer keys quantized before RoPE (KVQuant) against after it (today's cache).

A post-RoPE channel pair turns with position, so one scale and zero point per channel over a
block of tokens must span the whole circle of a fast pair; before RoPE a channel keeps its
outlier offset and its range. This measures what that is worth before building it: the keys of
every layer go through kvtune's own per-channel codes (`quantize_ref` / `dequantize_ref`,
fp16 scale and zero point per channel per block, the trailing partial block exact as in the
cache) either as they are (post-RoPE) or turned back to position 0 first and re-turned after
decoding (pre-RoPE); values stay exact. Printed per row: teacher-forced KL(exact || quantized)
of the next-token distribution and top-1 agreement, over a held-out text's tokens after the
first 256.

    .venv/bin/python -m benchmarks.prerope_keys [--tokens 2048] [--markdown]
"""

from __future__ import annotations

import argparse
import random

import torch
from rich.console import Console

from benchmarks.tables import print_rows
from kvtune.autotune.evaluation.haystack import held_out_paragraphs
from kvtune.kernels.kv_format import KVFormat
from kvtune.kernels.quantize import dequantize_ref, quantize_ref
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model import DenseCausalAttention, apply_rope

SKIPPED_TOKENS = 256  # the first positions see few keys: their KL says little about a cache
ROWS = [(bits, block) for bits in (4, 3, 2) for block in (64, 128)]


def held_out_ids(llm: LLM, tokens: int) -> torch.Tensor:
    """`tokens` ids of held-out paragraphs in a fixed shuffled order."""
    paragraphs = list(held_out_paragraphs())
    random.Random(0).shuffle(paragraphs)
    ids: list[int] = []
    for paragraph in paragraphs:
        ids += llm.tokenizer.encode(paragraph.text + "\n\n")
        if len(ids) >= tokens:
            return torch.tensor(ids[:tokens])
    raise ValueError(f"--tokens: {tokens}; allowed: at most {len(ids)} (the held-out text)")


def channel_codes(keys: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """keys [N, H, D] through fmt's per-channel codes; the trailing partial block stays exact."""
    full = keys.shape[0] // fmt.token_group * fmt.token_group
    out = keys.clone()
    codes, scales = quantize_ref(keys[:full], fmt)
    grouped = codes.unflatten(0, (-1, fmt.token_group))
    decoded = dequantize_ref(grouped, scales.unsqueeze(1), fmt, None, keys.shape[-1])
    out[:full] = decoded.flatten(0, 1).to(keys.dtype)
    return out


def log_probs(llm: LLM, ids: torch.Tensor, fmt: KVFormat | None, pre_rope: bool) -> torch.Tensor:
    """Next-token log-probabilities [N, vocab] with every layer's keys through fmt."""
    model = llm.model
    positions = torch.arange(len(ids))
    angles = positions.float()[:, None] * model.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(model.dtype), angles.sin().to(model.dtype)
    dense = DenseCausalAttention([len(ids)])

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if fmt is not None and pre_rope:
            k = apply_rope(channel_codes(apply_rope(k, cos, -sin), fmt), cos, sin)
        elif fmt is not None:
            k = channel_codes(k, fmt)
        return dense(layer, q, k, v)

    with torch.no_grad():
        return model.logits(model.forward(ids, positions, attention)).log_softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.tokens <= SKIPPED_TOKENS:
        parser.error(f"--tokens: {args.tokens}; allowed: more than {SKIPPED_TOKENS}")
    llm = LLM(args.model, policy=KVPolicy("auto", "auto"), max_model_len=args.tokens)
    ids = held_out_ids(llm, args.tokens)
    scored = slice(SKIPPED_TOKENS, None)
    exact = log_probs(llm, ids, None, False)[scored]
    rows = []
    for bits, block in ROWS:
        fmt = KVFormat(f"int{bits}", group_size=1, token_group=block)
        for pre_rope in (False, True):
            quantized = log_probs(llm, ids, fmt, pre_rope)[scored]
            kl = (exact.exp() * (exact - quantized)).sum(-1).mean().item()
            agree = (exact.argmax(-1) == quantized.argmax(-1)).float().mean().item()
            where = "before RoPE" if pre_rope else "after RoPE"
            rows.append([f"K int{bits} channel b{block}, {where}", f"{kl:.4f}", f"{agree:.3f}"])
    headers = ["keys (values exact)", "KL", "top-1 agreement"]
    print_rows(headers, rows, args.markdown, Console())


if __name__ == "__main__":
    main()
