"""One KVPolicy field at a time: its value checked against its vocabulary and normalised, or a
one-line ConfigError naming the field, the value and what is allowed.

Each check takes the field's name and value and returns the normalised value; KVPolicy attaches
one to each field it declares. The rules between fields are in rules.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.policy.vocabulary import KEEP_FRACTIONS, PER_TENSOR

Check = Callable[[str, Any], Any]


def field_name(name: str) -> str:
    """How errors name a policy field (as a Hydra override would)."""
    return f"policy.{name}"


def one_of(choices: Sequence[Any], shown: Callable[[Any], str] = str) -> Check:
    """A check accepting `choices` only (never a bool standing for 1 or 0)."""

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) or value not in choices:
            raise ConfigError(field_name(name), value, f"one of {', '.join(map(shown, choices))}")
        return value

    return check


def at_least(minimum: int) -> Check:
    """A check accepting integers >= minimum."""

    def check(name: str, value: Any) -> int:
        return checked_int(name, value, minimum)

    return check


def checked_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field_name(name), value, f"an integer >= {minimum}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field_name(name), value, "true or false")
    return value


def group_or_tensor(name: str, value: object) -> int | str:
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


def optional(check: Check) -> Check:
    """`check`, or null."""

    def checked_or_none(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return checked_or_none


def keep_fraction(name: str, value: Any) -> float:
    """A keep fraction as a float: 0 and 0.0 are one policy, one cache key."""
    return float(one_of(KEEP_FRACTIONS, "{:g}".format)(name, value))
