"""A memo of the last few results derived from objects that are never changed once made (a
decode step's block tables and query starts, read by every layer of the step): keyed by the
objects' identity, which costs nothing to check, where their contents would cost a pass."""

from __future__ import annotations

from typing import Any


class IdentityMemo:
    """The values of the `size` keys used last, a key being a tuple of objects matched by
    identity and held while cached, so that no id is reused meanwhile."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list[tuple[tuple[object, ...], Any]] = []

    def get(self, key: tuple[object, ...]) -> Any:
        """The value stored under key (now the most recent), or None."""
        for index, (held, value) in enumerate(self.entries):
            if len(held) == len(key) and all(a is b for a, b in zip(held, key, strict=True)):
                if index:
                    self.entries.insert(0, self.entries.pop(index))
                return value
        return None

    def put(self, key: tuple[object, ...], value: Any) -> Any:
        """Store value under key (forgetting the oldest beyond size); returns value."""
        self.entries = [(key, value), *self.entries[: self.size - 1]]
        return value
