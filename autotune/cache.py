"""Measurements cached on disk, keyed by everything that decides them.

A trial's measured metrics depend on the model, the canonical policy, the accuracy suite, the
workload and where it runs (backend, device, dtype), never on the study, the sampler or the
target device (capacity is arithmetic, recomputed each time). Keying by exactly those makes a
repeated policy free across studies and samplers. The sensitivity profile uses the same store.

Entries are JSON files named by the SHA-256 of the canonical key, written atomically (a
temporary file renamed into place), so concurrent workers never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.model_source import cache_dir

logger = logging.getLogger(__name__)

# Bump when a cached measurement would be computed differently.
CACHE_VERSION = 3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def model_fingerprint(folder: Path) -> str:
    """Identity of a model folder: its config.json and the names, sizes and mtimes of its weights.

    Cheap (no weights read) and changes whenever the checkpoint is replaced.
    """
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def key_digest(key: Mapping[str, Any]) -> str:
    canonical = json.dumps({"version": CACHE_VERSION, **key}, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class JsonCache:
    """A folder of JSON entries keyed by a dict (see module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: Mapping[str, Any]) -> Path:
        return self.folder / f"{key_digest(key)}.json"

    def get(self, key: Mapping[str, Any]) -> dict[str, Any] | None:
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())["value"]
        except (json.JSONDecodeError, KeyError):
            logger.warning("ignoring unreadable cache entry %s", path)
            return None

    def put(self, key: Mapping[str, Any], value: Mapping[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            json.dump({"key": key, "value": value}, out, sort_keys=True, default=str)
        os.replace(temporary, self._path(key))


def default_cache_folder(kind: str) -> Path:
    """<kvtune cache>/<kind>: evaluations, sensitivity."""
    return cache_dir() / kind
