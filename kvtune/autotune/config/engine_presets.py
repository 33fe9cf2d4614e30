"""The serving engines' own KV formats as kvtune policies (conf/policy/<engine>/<dtype>.yaml).

The export names an engine's --kv-cache-dtype exactly when a policy stores what a preset stores,
and benchmarks/formats.py measures every preset; both run outside Hydra's composition (or inside
another Hydra app), so a preset is composed here the way Hydra does it: conf/policy/default.yaml
under the preset file, with the model's head_dim for the per-token-head presets'
`${model.head_dim}`. tests/autotune/test_engine_preset_loading.py checks it against Hydra.
"""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import OmegaConf

from kvtune.runtime.policy import KVPolicy

POLICY_DIR = Path(__file__).resolve().parents[3] / "conf" / "policy"
ENGINES = ("vllm", "sglang", "llamacpp")


def preset_names() -> list[str]:
    """Every preset's "<engine>/<dtype>" name."""
    return [f"{e}/{path.stem}" for e in ENGINES for path in sorted((POLICY_DIR / e).glob("*.yaml"))]


def engine_presets(head_dim: int) -> dict[str, KVPolicy]:
    """Every preset as "<engine>/<dtype>" -> its policy for a model of this head_dim."""
    return dict(_composed_presets(head_dim))


@functools.cache
def _composed_presets(head_dim: int) -> tuple[tuple[str, KVPolicy], ...]:
    """The presets composed once a process and head_dim: every export asks which preset stores
    a trial's cache, and composing 21 files with OmegaConf each time cost most of an export."""
    default = OmegaConf.load(POLICY_DIR / "default.yaml")
    presets = {}
    for engine in ENGINES:
        for path in sorted((POLICY_DIR / engine).glob("*.yaml")):
            preset = OmegaConf.load(path)
            preset.pop("defaults", None)
            root = OmegaConf.create(
                {"model": {"head_dim": head_dim}, "policy": OmegaConf.merge(default, preset)}
            )
            data = OmegaConf.to_container(root.policy, resolve=True)
            presets[f"{engine}/{path.stem}"] = KVPolicy.from_dict(data)
    return tuple(presets.items())
