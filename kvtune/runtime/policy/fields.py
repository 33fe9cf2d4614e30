"""One KVPolicy field at a time: its value checked against its vocabulary and normalised, or a
one-line ConfigError naming the field, the value and what is allowed."""

from __future__ import annotations

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.kv_dtypes import KV_DTYPES
from kvtune.runtime.policy.vocabulary import PER_TENSOR


def field_name(name: str) -> str:
    """How errors name a policy field (as a Hydra override would)."""
    return f"policy.{name}"


def normalised_group_size(name: str, value: object) -> int | str:
    """A group size as an int (digits accepted) or "tensor"."""
    original = value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == PER_TENSOR:
        return PER_TENSOR
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            field_name(name), original, f'a positive integer dividing head_dim, or "{PER_TENSOR}"'
        )
    return value


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field_name(name), value, f"an integer >= {minimum}")
    return value


def check_dtype(name: str, value: object) -> str:
    if value not in KV_DTYPES:
        raise ConfigError(field_name(name), value, f"one of {', '.join(KV_DTYPES)}")
    return str(value)
