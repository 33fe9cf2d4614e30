"""Where kvtune keeps what it can rebuild (converted weights, evaluations, built CPU kernels):
one root that every layer reads, so that a single variable moves it all."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of kvtune's cache: $KVTUNE_CACHE, $XDG_CACHE_HOME/kvtune or ~/.cache/kvtune."""
    if os.environ.get("KVTUNE_CACHE"):
        return Path(os.environ["KVTUNE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtune"
