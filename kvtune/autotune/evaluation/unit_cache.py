"""An evaluation's finished units on disk, written as each finishes, so a killed run resumes.

A unit is one runtime call of the lm-eval backend (prefill_plan.PrefillUnit): at long contexts
one haystack's or one document's prefill and every request read from it. A long suite's
baseline is about ten 16K-token prefills of ten minutes each on two CPU cores; stored only when
a whole task finished, a run killed at the ninth lost all nine.

Keys are content only (kvtune/autotune/cache.py says why): the model files' hash, the canonical
policy, the runtime settings that change numbers, the producing code and its compute path
(UnitRuns.context), and the unit's own inputs as the backend names them (token ids, targets,
generation settings, and what the observer measures them against). Entries are torch files
(the fidelity rows are tensors) written atomically, so a kill mid-write leaves no entry. They
are a journal, not a result store: whoever stores the whole run then drops the entries it read
or wrote (`forget`), so thousands of trials do not pile up their rows on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from kvtune.autotune.cache import ACCURACY_CODE, code_key, key_digest, replace_atomically
from kvtune.runtime.fingerprint import model_fingerprint
from kvtune.runtime.llm import LLM
from kvtune.runtime.model_source import resolve_model
from kvtune.runtime.policy import canonical

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


class UnitRuns:
    """An LLM's runtime calls through an optional UnitCache, with the totals the engine's own
    counters lose once calls are read back: K/V values clipped and range-checked
    (kvtune/runtime/clip_counter.py), and the seconds read-back calls took when computed."""

    def __init__(self, llm: LLM, model: str, backend: str, cache: UnitCache | None) -> None:
        self.llm = llm
        self.model = model
        self.backend = backend
        self.cache = cache
        self.clipped_values = 0
        self.range_checked_values = 0
        self.read_back_seconds = 0.0

    @functools.cached_property
    def context(self) -> dict[str, Any]:
        """What decides every call's numbers besides its own inputs: the model files, the
        canonical policy, the runtime settings (backend, device, compute dtype, engine limits)
        and the producing code with its compute path."""
        return {
            "kind": "eval-unit",
            "model": model_fingerprint(resolve_model(self.model)),
            "policy": canonical(self.llm.policy).to_dict(),
            "runtime": {
                "backend": self.backend,
                "device": str(self.llm.device),
                "dtype": self.llm.arch.dtype,
                **dataclasses.asdict(self.llm.engine.config),
            },
            "code": code_key(*ACCURACY_CODE),
        }

    def run(self, inputs: dict[str, Any] | None, compute: Callable[[], list[Any]]) -> list[Any]:
        """One call's results: read back from the cache, or computed and stored there as soon as
        the call finishes. inputs: everything of the call's own that decides its results (None:
        a call never stored, as a sampled one); compute: the call."""
        cache = self.cache if inputs is not None else None
        key = {**self.context, "unit": inputs} if cache is not None else {}
        stored = cache.get(key) if cache is not None else None
        if stored is None:
            before, started = self.llm.stats(), time.perf_counter()
            results = compute()
            after = self.llm.stats()
            stored = {
                "results": results,
                "seconds": time.perf_counter() - started,
                "clipped": after["kv_clipped_values"] - before["kv_clipped_values"],
                "checked": after["kv_range_checked_values"] - before["kv_range_checked_values"],
            }
            if cache is not None:
                cache.put(key, stored)
        else:
            self.read_back_seconds += stored["seconds"]
        self.clipped_values += stored["clipped"]
        self.range_checked_values += stored["checked"]
        return stored["results"]
