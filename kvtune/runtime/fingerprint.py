"""Content fingerprints: a file's bytes, and the source code of modules by name.

Every cache keyed by content uses these (the converted-model folder here, the measurement
caches in autotune/cache.py), so a changed file or line of code misses and nothing is keyed by
a path or a hand-bumped version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Sequence
from pathlib import Path

_READ_BYTES = 1 << 24
# The files of a model folder that decide its outputs (weights, config, tokenizer).
MODEL_FILE_PATTERNS = (
    "config.json",
    "*.safetensors",
    "*.bin",
    "*.gguf",
    "tokenizer*",
    "special_tokens_map.json",
)

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
    """source_fingerprint of modules or packages by dotted name
    ("kvtune.runtime", "kvtune.autotune.evaluation"), hashed once a process: the code running
    cannot change under it."""
    paths = []
    for name in modules:
        file = Path(importlib.import_module(name).__file__ or name)
        paths.append(file.parent if file.name == "__init__.py" else file)
    return source_fingerprint(paths)
