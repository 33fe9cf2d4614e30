"""Turn composed Hydra config into validated objects (model, device, serving limits, policy).

Every command goes through these builders, so a bad value fails here with a one-line
ConfigError naming the field, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvtune.runtime.arch import GIB, ModelArch, arch_from_folder
from kvtune.runtime.dtypes import compute_dtype_name
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy import KVPolicy

ARCH_FIELDS: tuple[str, ...] = (
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "max_position_embeddings",
    "dtype",
)


@dataclass(frozen=True)
class DeviceSpec:
    """Target accelerator: memory for the capacity plan, bandwidth for roofline predictions."""

    name: str
    memory_gib: float
    bandwidth_gbps: float

    def __post_init__(self) -> None:
        if not self.memory_gib > 0:
            raise ConfigError("device.memory_gib", self.memory_gib, "a number > 0")
        if not self.bandwidth_gbps > 0:
            raise ConfigError("device.bandwidth_gbps", self.bandwidth_gbps, "a number > 0")


@dataclass(frozen=True)
class ServeSettings:
    """Serving limits: longest context, memory share, reserve for activations (GiB)."""

    max_model_len: int
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 1.0
    expected_context_len: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len <= 0
        ):
            raise ConfigError(
                "serve.max_model_len", self.max_model_len, "a positive integer (tokens)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "serve.gpu_memory_utilization", self.gpu_memory_utilization, "a fraction in (0, 1]"
            )
        if self.activation_reserve_gib < 0:
            raise ConfigError(
                "serve.activation_reserve_gib", self.activation_reserve_gib, "a number >= 0"
            )
        expected = self.expected_context_len
        if expected is not None and (not isinstance(expected, int) or expected <= 0):
            raise ConfigError("serve.expected_context_len", expected, "a positive integer or null")

    @property
    def typical_context_len(self) -> int:
        """The context a typical request has (tokens): expected_context_len where the workload
        gives one, else max_model_len. Engine configs are sized for it."""
        return self.expected_context_len or self.max_model_len


def _plain(node: Any) -> dict[str, Any]:
    return (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )


def overridden_keys(overrides: Iterable[str], group: str) -> set[str]:
    """Field names of `group` set on the command line (e.g. "model.num_layers=61" -> num_layers)."""
    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith(group + "."):
            keys.add(key[len(group) + 1 :])
    return keys


def _weights_bytes(gib: object) -> int:
    if isinstance(gib, bool) or not isinstance(gib, int | float) or gib < 0:
        raise ConfigError("model.weights_gib", gib, "a number >= 0 (GiB)")
    return int(gib * GIB)


def build_model_arch(model_cfg: Mapping[str, Any], command_line: Iterable[str] = ()) -> ModelArch:
    """ModelArch from a preset, or from `model.path`'s config.json.

    With a path, config.json decides every field except those given on the command line.
    """
    cfg = _plain(model_cfg)
    if "dtype" in cfg:  # spelt as vLLM and PyTorch users write it (float32, half, ...)
        cfg["dtype"] = compute_dtype_name(cfg["dtype"], field="model.dtype")
    if cfg.get("path"):
        explicit = overridden_keys(command_line, "model")
        arch = arch_from_folder(cfg["path"])
        changes = {k: cfg[k] for k in ARCH_FIELDS if k in explicit}
        if "weights_gib" in explicit:
            changes["weights_bytes"] = _weights_bytes(cfg["weights_gib"])
        return dataclasses.replace(arch, **changes)
    return ModelArch(
        name=cfg["name"],
        weights_bytes=_weights_bytes(cfg["weights_gib"]),
        **{k: cfg[k] for k in ARCH_FIELDS},
    )


def build_device(device_cfg: Mapping[str, Any]) -> DeviceSpec:
    cfg = _plain(device_cfg)
    return DeviceSpec(cfg["name"], float(cfg["memory_gib"]), float(cfg["bandwidth_gbps"]))


def build_serve(serve_cfg: Mapping[str, Any]) -> ServeSettings:
    return ServeSettings(**_plain(serve_cfg))


def build_policy(policy_cfg: Mapping[str, Any]) -> KVPolicy:
    return KVPolicy.from_dict(_plain(policy_cfg))
