"""Measurements cached on disk, keyed by the content of everything that decides them.

A key names what produced a number by content, never by where it lives or by a hand-kept
version: the model's files (config, weights, tokenizer) by SHA-256, the inputs (policy, the
suite's definition and the task data it generated, workload, passage), the code that computes
the number (a fingerprint of its Python source and which native CPU kernels ran: `code_key`),
and, for timings only, the machine that measured them.
So a changed checkpoint, suite or line of code misses, the same model copied elsewhere hits,
and an accuracy measured on one machine serves another while its latencies are re-measured.

Entries are JSON files named by the SHA-256 of the canonical key, written atomically (a
temporary file renamed into place), so concurrent workers never read half a file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvtune.cache_root import cache_dir
from kvtune.kernels.native.build import active_kernels
from kvtune.runtime.fingerprint import code_fingerprint

logger = logging.getLogger(__name__)

# The code that decides an accuracy (suite generation, scoring, the runtime and its kernels)
# and a latency (the timing loop, the trace and the same runtime).
ACCURACY_CODE = ("kvtune.kernels", "kvtune.runtime", "kvtune.autotune.evaluation")
LATENCY_CODE = (
    "kvtune.kernels",
    "kvtune.runtime",
    "kvtune.autotune.study.latency",
    "kvtune.autotune.config.workload",
)


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


def code_key(*modules: str) -> dict[str, Any]:
    """What computes a cached number: the Python source of `modules` (code_fingerprint) and the
    compute path this process runs, i.e. which C kernels are active (`active_kernels`: off with
    KVTUNE_NATIVE=0 or without a compiler), whose torch twins differ in the last bits."""
    return {"source": code_fingerprint(*modules), "native": active_kernels()}


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


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Write path through `write(temporary)` in its folder, then rename the temporary over it: a
    reader never sees half a file, and a process killed mid-write leaves only a stray *.tmp."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


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
        text = json.dumps({"key": key, "value": value}, sort_keys=True, default=str)
        replace_atomically(self._path(key), lambda temporary: temporary.write_text(text))


def default_cache_folder(kind: str) -> Path:
    """<kvtune cache>/<kind>: evaluations, sensitivity."""
    return cache_dir() / kind
