"""How a policy stores its streams on a model: each stream's KVFormat, and the settings a
model's vectors cannot hold (refused before its weights are loaded)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune.kernels.formats.kv_format import QUANTIZED_DTYPES, KVFormat
from kvtune.kernels.formats.rotation import POWER_OF_TWO_ROTATIONS, is_power_of_two
from kvtune.runtime.arch import ModelArch
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import AUTO
from kvtune.runtime.policy.fields import field_name
from kvtune.runtime.policy.vocabulary import (
    INDEX_GROUP,
    INDEX_IN_LAYER_FORMAT,
    NO_ROTATION,
    PER_TENSOR,
    WHOLE_VECTOR_DTYPES,
)

if TYPE_CHECKING:
    from kvtune.runtime.policy.schema import KVPolicy


def kv_format(policy: KVPolicy, dtype: str, auto_dtype: str, keys: bool = False) -> KVFormat:
    """Storage format of a stream whose element dtype is `dtype` (auto -> the model's);
    keys: the stream holds keys (k_scale_axis applies)."""
    size = policy.key_group_size if keys else policy.group_size
    group = None if size == PER_TENSOR else size
    element = auto_dtype if dtype == AUTO else dtype
    if keys and policy.k_scale_axis == "channel" and element in QUANTIZED_DTYPES:
        return KVFormat(
            element,
            1,
            policy.scale_dtype,
            token_group=policy.block_size,
            tensor_scale=policy.tensor_scale,
        )
    return KVFormat(element, group, policy.scale_dtype, tensor_scale=policy.tensor_scale)


def check_model(policy: KVPolicy, arch: ModelArch) -> None:
    """Refuse settings this model cannot hold (before its weights are loaded)."""
    pairs = policy.layer_pairs(arch.num_layers)
    policy.layer_topk(arch.num_layers)
    policy.layer_select_every(arch.num_layers)
    size = arch.cached_vector_size
    for name in ("group_size", "k_group_size"):
        check_group_size(name, getattr(policy, name), arch)
    for stream, name, group in (
        (0, policy.key_group_field, policy.key_group_size),
        (1, "group_size", policy.group_size),
    ):
        streams = {pair[stream] for pair in pairs}
        whole = sorted(streams & set(WHOLE_VECTOR_DTYPES))
        if whole and group != size:
            raise ConfigError(
                field_name(name),
                group,
                f"head_dim={size} with {', '.join(whole)} (whole vectors)",
            )
    check_rotation(policy.rotation, arch)
    if policy.separate_index and (arch.is_mla or size % INDEX_GROUP):
        raise ConfigError(
            field_name("csa_index_dtype"),
            policy.csa_index_dtype,
            f"{INDEX_IN_LAYER_FORMAT} on this model (a separate index needs K and V heads "
            f"whose head_dim is a multiple of {INDEX_GROUP}; it has head_dim={size}"
            f"{', MLA' if arch.is_mla else ''})",
        )
    if arch.is_mla and any(k != v for k, v in pairs):
        raise ConfigError(
            field_name("v_dtype"),
            policy.v_dtype,
            "equal to k_dtype in every layer: an MLA model caches one latent for K and V",
        )


def check_group_size(name: str, group: int | str | None, arch: ModelArch) -> None:
    """A group size must divide the cached vector; checked even when no stream is quantized (a
    value is valid or not whatever the dtypes). The search space checks its candidates here."""
    size = arch.cached_vector_size
    if isinstance(group, int) and size % group:
        divisors = [g for g in (8, 16, 32, 64, 128) if size % g == 0 and g < size]
        allowed = ", ".join(map(str, [*divisors, size])) + f", or {PER_TENSOR}"
        raise ConfigError(field_name(name), group, f"must divide head_dim={size}: {allowed}")


def check_rotation(rotation: str, arch: ModelArch) -> None:
    """A rotation must suit the model's heads; checked even when no stream is quantized (then
    it is not applied). The search space checks its candidates here."""
    if rotation == NO_ROTATION:
        return
    if arch.is_mla:
        raise ConfigError(
            field_name("rotation"),
            rotation,
            f"{NO_ROTATION} on an MLA model (it caches one latent, not K and V per head)",
        )
    if rotation in POWER_OF_TWO_ROTATIONS and not is_power_of_two(arch.cached_vector_size):
        raise ConfigError(
            field_name("rotation"),
            rotation,
            f"{NO_ROTATION} or vllm_rht (the {rotation} rotation needs a power-of-two "
            f"head_dim; the model has head_dim={arch.cached_vector_size})",
        )
