"""Compiling a C kernel once per machine and loading it: the shared library is cached under
kvtune's cache, named by a hash of its source, the flags, the compiler's version and the CPU
(it is built for the CPU it runs on), so that a changed input builds a new one."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from kvtune.cache_root import cache_dir

logger = logging.getLogger(__name__)

# Not contracting multiplies and adds into fused ones keeps the kernels' rounding that of the
# torch operations they replace. OpenMP: torch's own runtime (one per process) runs the threads.
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-std=c11",
    "-shared",
    "-fPIC",
)
# Set to 0 to run the torch paths only.
ENABLE_VARIABLE = "KVTUNE_NATIVE"
# Kernels (C source stems, comma-separated, e.g. decode_attention) whose torch paths run
# instead, the others staying on: one kernel timed or checked against its torch path.
DISABLE_VARIABLE = "KVTUNE_NATIVE_OFF"


def native_enabled(stem: str) -> bool:
    """Whether the kernel of C source `stem` runs (neither all nor it disabled)."""
    if os.environ.get(ENABLE_VARIABLE, "1") == "0":
        return False
    return stem not in os.environ.get(DISABLE_VARIABLE, "").split(",")


def active_kernels() -> dict[str, str | None]:
    """Which C kernels compute in this process, for the keys of cached measurements (a kernel
    and its torch path agree only to the last bits of rotations and index products): per C
    source of this package (every kernel lives here, by file stem), a hash of its source and
    flags where it is enabled and builds here, None where its torch path runs instead
    (KVTUNE_NATIVE=0, named in KVTUNE_NATIVE_OFF, no compiler, a failed build). Builds each
    kernel on its first use."""
    return {
        source.stem: _source_digest(source) if load_kernel(source) is not None else None
        for source in sorted(Path(__file__).parent.glob("*.c"))
    }


def load_kernel(source: Path) -> ctypes.CDLL | None:
    """The library built from source (a C file), or None when native kernels, or this one, are
    disabled or it cannot be built here (the reason is logged once)."""
    return _load(source) if native_enabled(source.stem) else None


@functools.cache
def _load(source: Path) -> ctypes.CDLL | None:
    compiler, version = _compiler()
    if compiler is None:
        logger.warning("native kernels: no C compiler (cc or $CC); the torch paths run instead")
        return None
    key = hashlib.sha256()
    for part in (_source_digest(source), version, _cpu()):
        key.update(part.encode())
    target = cache_dir() / "native" / f"{source.stem}-{key.hexdigest()[:20]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        built = subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        if built.returncode:
            logger.warning(
                "native kernels: %s failed to build (%s); the torch paths run instead",
                source.name,
                built.stderr.strip().splitlines()[-1:] or built.returncode,
            )
            return None
        os.replace(partial, target)  # atomic: concurrent builders leave one whole file
    return ctypes.CDLL(str(target))


def _source_digest(source: Path) -> str:
    """SHA-256 prefix of what decides a kernel's numbers: its source, the headers of this
    folder it includes and the flags (the machine's compiler and CPU name only where its
    library lies)."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode())
    for header in _local_headers(source):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()[:16]


def _local_headers(source: Path) -> list[Path]:
    """The headers source names by `#include "name"` (beside it), in the order it names them."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [source.parent / name for name in names]


@functools.cache
def _compiler() -> tuple[str | None, str]:
    """The C compiler's path (None: none found) and its version, asked once for all kernels."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, ""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return compiler, version.stdout


@functools.cache
def _cpu() -> str:
    """The machine and, on Linux, its CPU's feature flags: what -march=native builds for."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {flags}"
