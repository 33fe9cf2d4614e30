#!/usr/bin/env bash
# Optional extra for benchmarks/llamacpp_peer.py: llama-cpp-python 0.3.36 (the release whose
# vendored llama.cpp, commit 0c1e570, kvtune's ggml formats are pinned to), CPU only.
# Kept out of scripts/setup.sh and CI: it compiles llama.cpp from source, 610 CPU-seconds
# (1174 s wall on the project's 2-core machine while other jobs ran; benchmarks/RESULTS.md,
# "llama.cpp peer run").
# The wheel is built once into a cache folder and reused; installing it takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
wheels=${KVTUNE_WHEELS:-$HOME/.cache/kvtune/wheels}
mkdir -p "$wheels"

if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    echo "llamacpp_extra: building llama-cpp-python==$version (CPU) into $wheels" >&2
    start=$(date +%s)
    # A plain CPU build: no BLAS, no GPU backend, no multimodal library (LLAVA_BUILD: Llama
    # loads it only for image chats); the compiler tunes for this CPU (GGML_NATIVE).
    CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF"} \
        CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        .venv/bin/pip wheel --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$version" -w "$wheels"
    echo "llamacpp_extra: built in $(($(date +%s) - start)) s" >&2
fi
# Its runtime dependencies (numpy, jinja2, typing-extensions, diskcache) are already in .venv
# except diskcache; --no-deps keeps pip from touching kvtune's pins.
.venv/bin/pip install -q diskcache
.venv/bin/pip install -q --no-deps "$wheels"/llama_cpp_python-"$version"-*.whl
.venv/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
