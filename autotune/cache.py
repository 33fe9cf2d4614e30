"""Measurements cached on disk, keyed by the content of everything that decides them.

A key names what produced a number by content, never by where it lives or by a hand-kept
version: the model's files (config, weights, tokenizer) by SHA-256, the inputs (policy, the
suite's definition and the task data it generated, workload, passage), a fingerprint of the
source code that computes the number, and, for timings only, the machine that measured them.
So a changed checkpoint, suite or line of code misses, the same model copied elsewhere hits,
and an accuracy measured on one machine serves another while its latencies are re-measured.

Entries are JSON files named by the SHA-256 of the canonical key, written atomically (a
temporary file renamed into place), so concurrent workers never read half a file.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.model_source import cache_dir

logger = logging.getLogger(__name__)

# The files of a model folder that decide its outputs (weights, config, tokenizer).
MODEL_FILE_PATTERNS = (
    "config.json",
    "*.safetensors",
    "*.bin",
    "*.gguf",
    "tokenizer*",
    "special_tokens_map.json",
)
# The code that decides an accuracy (suite generation, scoring, the runtime and its kernels)
# and a latency (the timing loop, the trace and the same runtime).
ACCURACY_CODE = ("kernels", "runtime", "autotune.evaluation")
LATENCY_CODE = ("kernels", "runtime", "autotune.study.latency", "autotune.config.workload")
_READ_BYTES = 1 << 24

_file_digests: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes.

    Read once a process: the digest is memoised by (resolved path, size, mtime) as a speed-up
    only; keys hold the digest, never the path or the mtime.
    """
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _file_digests:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(_READ_BYTES), b""):
                digest.update(block)
        _file_digests[memo] = digest.hexdigest()
    return _file_digests[memo]


def model_fingerprint(folder: Path) -> str:
    """Content hash of a model folder's config, weights and tokenizer files (names within the
    folder and bytes): the same files anywhere give the same value, changed bytes another."""
    files = sorted({p for pattern in MODEL_FILE_PATTERNS for p in folder.glob(pattern)})
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            digest.update(f"{path.name}\0{file_digest(path)}\n".encode())
    return digest.hexdigest()[:16]


def source_fingerprint(sources: Sequence[Path]) -> str:
    """SHA-256 prefix of the Python source under each of `sources` (a package folder or one
    file): every file's name relative to its source, and its bytes. Where the tree lies does
    not enter it."""
    digest = hashlib.sha256()
    for source in sources:
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            digest.update(f"{path.relative_to(source.parent).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


@functools.cache
def code_fingerprint(*modules: str) -> str:
    """source_fingerprint of modules or packages by dotted name ("runtime",
    "autotune.evaluation"), hashed once a process: the code running cannot change under it."""
    paths = []
    for name in modules:
        file = Path(importlib.import_module(name).__file__ or name)
        paths.append(file.parent if file.name == "__init__.py" else file)
    return source_fingerprint(paths)


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_fingerprint(device: str) -> dict[str, Any]:
    """What decides a timing besides the code and the inputs: CPU model, cores this process may
    use, torch and triton versions, and the accelerator's name ("cpu" for a CPU device)."""
    name = "cpu"
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": cores,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "device": name,
    }


def key_digest(key: Mapping[str, Any]) -> str:
    """SHA-256 of a key's canonical JSON (plain JSON values only: a Path refuses to enter)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


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
