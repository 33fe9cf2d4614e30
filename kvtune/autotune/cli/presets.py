"""Presets named on the command line (`model=<name>`, `policy=vllm/fp8`, ...) exist.

Hydra answers an unknown preset with a dozen lines (its search path, a hint about
HYDRA_FULL_ERROR) and exit code 1; kvtune checks the names first so that a misspelt model or
policy is one line naming the group and what it offers, like every other bad setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtune.runtime.errors import ConfigError

SEARCHPATH_KEY = "hydra.searchpath"
FILE_SCHEME = "file://"


def _search_roots(conf_dir: Path, overrides: Sequence[str]) -> list[Path] | None:
    """conf_dir and the folders hydra.searchpath adds; None when it adds a non-file source
    (a package), whose presets cannot be listed here."""
    roots = [conf_dir]
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") != SEARCHPATH_KEY:
            continue
        for entry in value.strip("[]").split(","):
            entry = entry.strip().strip("'\"")
            if not entry.startswith(FILE_SCHEME):
                return None
            roots.append(Path(entry[len(FILE_SCHEME) :]))
    return roots


def _choices(roots: Sequence[Path], group: str) -> set[str]:
    """Preset names of a config group: its YAML files' paths below the group, without .yaml."""
    names = set()
    for root in roots:
        folder = root / group
        names |= {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml")}
    return names


def check_presets(conf_dir: Path, overrides: Sequence[str]) -> None:
    """ConfigError for the first `group=name` override of a group in conf_dir that names no
    preset (each name of a multirun sweep `a,b` is checked; sweep functions are left to Hydra)."""
    roots = _search_roots(conf_dir, overrides)
    if roots is None:
        return
    for override in overrides:
        key, equals, value = override.partition("=")
        group = key.lstrip("+")
        if not equals or "." in group or not (conf_dir / group).is_dir() or "(" in value:
            continue
        choices = _choices(roots, group)
        for name in value.split(","):
            if name not in choices and name != "null":
                raise ConfigError(group, name, f"a preset: one of {', '.join(sorted(choices))}")
