"""An evaluation's finished units on disk, written as each finishes, so a killed run resumes.

A unit is one runtime call of the lm-eval backend (prefill_plan.PrefillUnit): at long contexts
one haystack's or one document's prefill and every request read from it. A long suite's
baseline is about ten 16K-token prefills of ten minutes each on two CPU cores; stored only when
a whole task finished, a run killed at the ninth lost all nine.

Keys are content only (kvtune/autotune/cache.py says why): the backend builds them from the
model files' hash, the canonical policy, the runtime settings that change numbers, the producing
code and its compute path, and the unit's own inputs (lm_backend.KVTuneLM.unit_context). Entries
are torch files (the fidelity rows are tensors) written atomically, so a kill mid-write leaves no
entry. They are a journal, not a result store: whoever stores the whole run then drops the
entries it read or wrote (`forget`), so thousands of trials do not pile up their rows on disk.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvtune.autotune.cache import key_digest, replace_atomically

logger = logging.getLogger(__name__)


class UnitCache:
    """A folder of unit results keyed by content (module docstring); counts its hits and
    misses (computed units) for logs and tests."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.hits = 0
        self.misses = 0
        self._used: set[Path] = set()

    def _path(self, key: Mapping[str, Any]) -> Path:
        return self.folder / f"{key_digest(key)}.pt"

    def get(self, key: Mapping[str, Any]) -> Any | None:
        """The stored value, or None (counted as a miss: the caller computes it)."""
        path = self._path(key)
        self._used.add(path)
        value = None
        if path.is_file():
            try:
                value = torch.load(path, weights_only=True)
            except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
                logger.warning("ignoring unreadable unit %s", path)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    def put(self, key: Mapping[str, Any], value: Any) -> None:
        path = self._path(key)
        self._used.add(path)
        replace_atomically(path, lambda temporary: torch.save(value, temporary))

    def forget(self) -> None:
        """Delete the entries this cache read or wrote (the whole run is stored elsewhere)."""
        if self.hits:
            logger.info("resumed: %d units read back, %d computed", self.hits, self.misses)
        for path in self._used:
            path.unlink(missing_ok=True)
        self._used.clear()


def unit_folder(root: Path) -> Path:
    """Where the evaluations under an eval cache root (evaluator.eval_cache_dir) keep units."""
    return root / "units"
