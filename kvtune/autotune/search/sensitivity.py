"""Per-layer sensitivity to FP4: what putting one layer's K (or V) alone into fp4 costs.

DESIGN.md section 2: keys are usually more sensitive than values and some layers far more than
others, but it differs by model, so kvtune measures it: for each layer, the mean KL divergence
(nats per token) of the next-token distribution when only that layer's K, then only its V, is
stored in fp4, against the exact cache, over a fixed text. The profile is cached by the model
files' content, the runtime settings and the code that measures it (2 x num_layers prefills
the first time, free afterwards). Layers are then grouped by their
total cost so that the search assigns dtypes per group instead of per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtune.autotune.cache import JsonCache, code_key
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.llm import LLM
from kvtune.runtime.policy import KVPolicy
from kvtune.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PROFILE_TEXT = (
    "A lighthouse keeper on a northern island kept a logbook for forty-one years. Each "
    "morning she wrote the wind direction, the height of the swell and the ships that "
    "passed: the ferry at 07:15, a trawler named Aurora, once a tall ship with 3 masts. "
    "Visitors asked why she never left. She said the light needed someone who knew its "
    "moods, and that the sea was never the same twice."
)
PROBE_DTYPE = "fp4"
PROBE_GROUP = 32
# What decides a profile besides the model and runtime settings (the text and probes are here).
SENSITIVITY_CODE = ("kvtune.kernels", "kvtune.runtime", __name__)


@dataclass(frozen=True)
class RuntimeSettings:
    """Where measurements run: kernel backend, torch device and compute dtype."""

    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "fp32"


@dataclass(frozen=True)
class LayerSensitivity:
    """KL cost (nats/token) of fp4 in one layer: k_kl[i] for K alone, v_kl[i] for V alone."""

    k_kl: tuple[float, ...]
    v_kl: tuple[float, ...]

    @property
    def scores(self) -> list[float]:
        return [k + v for k, v in zip(self.k_kl, self.v_kl, strict=True)]


def probe_policy(arch: ModelArch, layer: int, stream: str) -> KVPolicy:
    """Exact cache everywhere except one layer's K or V stream in fp4."""
    size = arch.cached_vector_size
    group = PROBE_GROUP if size % PROBE_GROUP == 0 else size
    pairs = ["auto/auto"] * arch.num_layers
    pairs[layer] = f"{PROBE_DTYPE}/auto" if stream == "k" else f"auto/{PROBE_DTYPE}"
    return KVPolicy(k_dtype="auto", v_dtype="auto", layer_dtypes=tuple(pairs), group_size=group)


def mean_kl(reference: torch.Tensor, probe: torch.Tensor) -> float:
    """Mean over positions of KL(reference || probe) from two [tokens, vocab] logit tensors."""
    ref = torch.log_softmax(reference.double(), dim=-1)
    other = torch.log_softmax(probe.double(), dim=-1)
    return float((ref.exp() * (ref - other)).sum(dim=-1).mean())


def exact_runtime(model: str, runtime: RuntimeSettings, max_model_len: int) -> LLM:
    """The model loaded once with the exact cache; probes switch policy without reloading."""
    return LLM(
        model,
        KVPolicy(k_dtype="auto", v_dtype="auto"),
        backend=runtime.backend,
        device=runtime.device,
        dtype=runtime.dtype,
        max_num_seqs=1,
        max_model_len=max_model_len,
    )


def measure_sensitivity(
    model: str, folder: Path, arch: ModelArch, runtime: RuntimeSettings
) -> LayerSensitivity:
    """Run the profile: one exact prefill and two probes a layer."""
    ids = Tokenizer.from_folder(folder).encode(PROFILE_TEXT)
    exact = exact_runtime(model, runtime, len(ids))
    reference = exact.prompt_logits(ids)
    costs: dict[str, list[float]] = {"k": [], "v": []}
    for layer in range(arch.num_layers):
        for stream in ("k", "v"):
            probe = exact.with_policy(probe_policy(arch, layer, stream)).prompt_logits(ids)
            costs[stream].append(mean_kl(reference, probe))
        logger.info("sensitivity layer %d: K %.2e V %.2e", layer, costs["k"][-1], costs["v"][-1])
    return LayerSensitivity(tuple(costs["k"]), tuple(costs["v"]))


def sensitivity_key(folder: Path, runtime: RuntimeSettings) -> dict[str, Any]:
    return {
        "kind": "sensitivity",
        "model": model_fingerprint(folder),
        "runtime": vars(runtime),
        "code": code_key(*SENSITIVITY_CODE),
    }


def layer_sensitivity(
    model: str, folder: Path, arch: ModelArch, runtime: RuntimeSettings, cache: JsonCache
) -> LayerSensitivity:
    """The cached profile of a model, measured on first use."""
    key = sensitivity_key(folder, runtime)
    cached = cache.get(key)
    if cached is not None:
        return LayerSensitivity(tuple(cached["k_kl"]), tuple(cached["v_kl"]))
    logger.info("measuring fp4 sensitivity of %d layers (cached afterwards)", arch.num_layers)
    profile = measure_sensitivity(model, folder, arch, runtime)
    cache.put(key, {"k_kl": list(profile.k_kl), "v_kl": list(profile.v_kl)})
    return profile


def group_layers(scores: Sequence[float], num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Split layers into num_groups groups of near-equal size by ascending score.

    Group 0 holds the least sensitive layers; each group lists its layers in layer order.
    """
    order = np.argsort(np.asarray(scores), kind="stable")
    return tuple(tuple(sorted(int(i) for i in part)) for part in np.array_split(order, num_groups))
