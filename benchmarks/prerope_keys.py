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

`--rows kvquant` measures KVQuant's two other parts on pre-RoPE keys: a non-uniform codebook
(NUQ) per layer, fitted by 1-D k-means to the layer's normalised calibration keys, unweighted
("nuq") or weighted by each key's squared loss gradient ("fisher", KVQuant's objective), "-ends"
with the outer levels pinned to each block's minimum and maximum; and dense-and-
sparse outliers (per channel, the calibration keys' lower and upper fraction / 2 quantiles are
thresholds; keys beyond them are kept exact beside the codes, and the block's range is taken
over the rest). Calibration keys come from the held-out text that follows the scored tokens, so
no scored token calibrates. Bits per key element count the codes, an fp16 minimum and range
per channel per block, and 32 bits (fp16 value, 16-bit place) per outlier measured.

    .venv/bin/python -m benchmarks.prerope_keys [--tokens 2048] [--rows rope|kvquant] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.console import Console

from benchmarks.tables import print_rows
from kvtune.autotune.evaluation.haystack import held_out_paragraphs
from kvtune.kernels.formats.kv_format import KVFormat
from kvtune.kernels.formats.quantize import dequantize_ref, quantize_ref
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.model import DenseCausalAttention, apply_rope

SKIPPED_TOKENS = 256  # the first positions see few keys: their KL says little about a cache
ROWS = [(bits, block) for bits in (4, 3, 2) for block in (64, 128)]
# (bits, block, codebook, outlier fraction): pre-RoPE keys, KVQuant's parts one at a time.
KVQUANT_ROWS = [
    (3, 128, "uniform", 0.0),
    (3, 128, "uniform", 0.01),
    (3, 128, "nuq", 0.0),
    (3, 128, "nuq", 0.01),
    (3, 128, "nuq-ends", 0.0),
    (3, 128, "nuq-ends", 0.01),
    (3, 64, "nuq-ends", 0.01),
    (3, 128, "nuq", 0.02),
    (4, 128, "nuq", 0.01),
    (3, 128, "fisher", 0.0),
    (3, 128, "fisher", 0.01),
    (3, 128, "fisher-ends", 0.01),
]
KMEANS_ROUNDS = 60
OUTLIER_BITS = 32  # an fp16 value and a 16-bit place in its block


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


@dataclass(frozen=True)
class LayerCodebook:
    """One layer's KVQuant key quantizer, fitted on calibration keys."""

    levels: torch.Tensor  # [2^bits] in [0, 1], increasing
    low: torch.Tensor  # [H, D] outlier thresholds (keys below are kept exact)
    high: torch.Tensor  # [H, D] (keys above are kept exact)


def _block_ranges(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-rounded minimum and range [blocks, 1, H, D] per channel of whole blocks of keys."""
    grouped = keys.unflatten(0, (-1, block))
    low = grouped.amin(dim=1, keepdim=True).half().float()
    span = (grouped.amax(dim=1, keepdim=True) - low).half().float()
    return low, span


def fit_codebook(
    keys: torch.Tensor,
    weights: torch.Tensor,
    bits: int,
    block: int,
    codebook: str,
    outliers: float,
) -> LayerCodebook:
    """The layer's levels and per-channel outlier thresholds (none when outliers is 0) from
    pre-RoPE calibration keys [N, H, D]. Levels: uniform; "nuq": 1-D k-means over the keys
    normalised to their block's range; "fisher": the same weighted by `weights` (each key's
    squared loss gradient, KVQuant's sensitivity); "-ends": the outer levels pinned to 0 and 1,
    so that every block's minimum and maximum stay exact."""
    if outliers:
        low = keys.quantile(outliers / 2, dim=0)
        high = keys.quantile(1 - outliers / 2, dim=0)
    else:
        low = torch.full(keys.shape[1:], -math.inf)
        high = torch.full(keys.shape[1:], math.inf)
    levels = torch.linspace(0, 1, 2**bits)
    if codebook == "uniform":
        return LayerCodebook(levels, low, high)
    full = keys.shape[0] // block * block
    whole = keys[:full].clamp(low, high)
    start, span = _block_ranges(whole, block)
    unit = ((whole.unflatten(0, (-1, block)) - start) / span.clamp(min=1e-6)).flatten()
    weight = weights[:full].flatten() if codebook.startswith("fisher") else torch.ones_like(unit)
    for _ in range(KMEANS_ROUNDS):
        nearest = (unit[:, None] - levels[None, :]).abs().argmin(dim=1)
        sums = torch.zeros_like(levels).index_add_(0, nearest, unit * weight)
        mass = torch.zeros_like(levels).index_add_(0, nearest, weight)
        levels = torch.where(mass > 0, sums / mass.clamp(min=1e-30), levels).sort().values
        if codebook.endswith("-ends"):
            levels[0], levels[-1] = 0.0, 1.0
    return LayerCodebook(levels, low, high)


def kvquant_codes(keys: torch.Tensor, block: int, book: LayerCodebook) -> tuple[torch.Tensor, int]:
    """(keys [N, H, D] through the codebook with outliers kept exact and the trailing partial
    block exact, the number of outliers kept)."""
    full = keys.shape[0] // block * block
    whole = keys[:full]
    exact = (whole < book.low) | (whole > book.high)
    clamped = whole.clamp(book.low, book.high)
    start, span = _block_ranges(clamped, block)
    unit = (clamped.unflatten(0, (-1, block)) - start) / span.clamp(min=1e-6)
    nearest = (unit[..., None] - book.levels).abs().argmin(dim=-1)
    decoded = (start + book.levels[nearest] * span).flatten(0, 1)
    out = keys.clone()
    out[:full] = torch.where(exact, whole, decoded)
    return out, int(exact.sum())


def rope_tables(llm: LLM, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [count, head_dim] of positions 0..count-1, as the model builds them."""
    model = llm.model
    angles = torch.arange(count).float()[:, None] * model.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(model.dtype), angles.sin().to(model.dtype)


KeyTransform = Callable[[int, torch.Tensor], torch.Tensor]


def log_probs(llm: LLM, ids: torch.Tensor, transform: KeyTransform | None) -> torch.Tensor:
    """Next-token log-probabilities [N, vocab] with every layer's post-RoPE keys through
    transform(layer, keys) (None: exact)."""
    model = llm.model
    dense = DenseCausalAttention([len(ids)])

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense(layer, q, k if transform is None else transform(layer, k), v)

    with torch.no_grad():
        return model.logits(model.forward(ids, torch.arange(len(ids)), attention)).log_softmax(-1)


def pre_rope_keys(llm: LLM, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys [N, H, D] turned back to position 0 for the text ids, and the square
    of the gradient of the text's next-token loss with respect to each of them (KVQuant's
    Fisher-information sensitivity: the rotation is orthonormal, so the pre-RoPE gradient is the
    post-RoPE one turned back)."""
    model = llm.model
    cos, sin = rope_tables(llm, len(ids))
    dense = DenseCausalAttention([len(ids)])
    leaves: list[torch.Tensor] = []

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k.detach().requires_grad_()
        leaves.append(k)
        return dense(layer, q, k, v)

    with torch.enable_grad():
        hidden = model.forward(ids, torch.arange(len(ids)), attention)
        loss = F.cross_entropy(model.logits(hidden[:-1]), ids[1:], reduction="sum")
        loss.backward()
    keys = [apply_rope(k.detach(), cos, -sin).float() for k in leaves]
    weights = [apply_rope(k.grad, cos, -sin).float().square() for k in leaves]
    return keys, weights


def codes_transform(
    fmt: KVFormat, pre_rope: bool, cos: torch.Tensor, sin: torch.Tensor
) -> KeyTransform:
    """kvtune's per-channel codes, after RoPE or before it."""
    if pre_rope:
        return lambda layer, k: apply_rope(channel_codes(apply_rope(k, cos, -sin), fmt), cos, sin)
    return lambda layer, k: channel_codes(k, fmt)


def kvquant_transform(
    books: list[LayerCodebook], block: int, cos: torch.Tensor, sin: torch.Tensor, kept: list[int]
) -> KeyTransform:
    """Keys turned back to position 0, through the layer's codebook, and turned again; each
    layer's count of outliers kept exact is appended to `kept`."""

    def transform(layer: int, k: torch.Tensor) -> torch.Tensor:
        decoded, count = kvquant_codes(apply_rope(k, cos, -sin).float(), block, books[layer])
        kept.append(count)
        return apply_rope(decoded.to(k.dtype), cos, sin)

    return transform


def kl_row(exact: torch.Tensor, quantized: torch.Tensor) -> list[str]:
    """KL(exact || quantized) and top-1 agreement of scored log-probabilities."""
    kl = (exact.exp() * (exact - quantized)).sum(-1).mean().item()
    agree = (exact.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    return [f"{kl:.4f}", f"{agree:.3f}"]


def rope_rows(llm: LLM, ids: torch.Tensor, exact: torch.Tensor, scored: slice) -> list[list[str]]:
    """kvtune's integer per-channel keys after and before RoPE, values exact."""
    cos, sin = rope_tables(llm, len(ids))
    rows = []
    for bits, block in ROWS:
        fmt = KVFormat(f"int{bits}", group_size=1, token_group=block)
        for pre_rope in (False, True):
            quantized = log_probs(llm, ids, codes_transform(fmt, pre_rope, cos, sin))[scored]
            where = "before RoPE" if pre_rope else "after RoPE"
            rows.append([f"K int{bits} channel b{block}, {where}", *kl_row(exact, quantized)])
    return rows


def kvquant_rows(
    llm: LLM, ids: torch.Tensor, calibration: torch.Tensor, exact: torch.Tensor, scored: slice
) -> list[list[str]]:
    """Pre-RoPE keys through KVQuant's codebooks and outliers, values exact."""
    cos, sin = rope_tables(llm, len(ids))
    keys, weights = pre_rope_keys(llm, calibration)
    rows = []
    for bits, block, codebook, outliers in KVQUANT_ROWS:
        books = [
            fit_codebook(layer_keys, layer_weights, bits, block, codebook, outliers)
            for layer_keys, layer_weights in zip(keys, weights, strict=True)
        ]
        kept: list[int] = []
        transform = kvquant_transform(books, block, cos, sin, kept)
        quantized = log_probs(llm, ids, transform)[scored]
        elements = len(ids) // block * block * llm.arch.num_kv_heads * llm.arch.head_dim
        share = sum(kept) / (elements * len(books))
        key_bits = bits + 32 / block + share * OUTLIER_BITS
        name = f"K {codebook}{bits} channel b{block}, before RoPE, {outliers:.0%} outliers"
        rows.append([name, f"{key_bits:.2f}", f"{share:.4f}", *kl_row(exact, quantized)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", default="rope", choices=("rope", "kvquant"))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.tokens <= SKIPPED_TOKENS:
        parser.error(f"--tokens: {args.tokens}; allowed: more than {SKIPPED_TOKENS}")
    llm = LLM(args.model, policy=KVPolicy("auto", "auto"), max_model_len=args.tokens)
    # The scored text, and (kvquant) as many following tokens to calibrate on.
    text = held_out_ids(llm, 2 * args.tokens if args.rows == "kvquant" else args.tokens)
    ids, calibration = text[: args.tokens], text[args.tokens :]
    scored = slice(SKIPPED_TOKENS, None)
    exact = log_probs(llm, ids, None)[scored]
    if args.rows == "rope":
        rows = rope_rows(llm, ids, exact, scored)
        headers = ["keys (values exact)", "KL", "top-1 agreement"]
    else:
        rows = kvquant_rows(llm, ids, calibration, exact, scored)
        headers = ["keys (values exact)", "bits a key element", "outliers", "KL", "top-1 agreement"]
    print_rows(headers, rows, args.markdown, Console())


if __name__ == "__main__":
    main()
