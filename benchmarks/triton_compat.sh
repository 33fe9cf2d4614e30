#!/usr/bin/env bash
# Do the Triton kernels work on Triton 3.6.0, the version the lent GPU machine has (the project
# pins 3.7.1)? Builds a throwaway venv outside the repo (torch 2.13.0 CPU + triton 3.6.0),
# then runs, under both Triton versions: the kernel tests under TRITON_INTERPRET=1 and the sm_90
# compile check (every kernel compiled to an H100/H200 cubin, no GPU needed). Triton 3.6.0's
# interpreter converts 1-element arrays with int(), which NumPy >= 2.4 refuses, so its
# interpreter run is repeated with NumPy 2.3 first on the path (the GPU runs compiled code).
#   bash benchmarks/triton_compat.sh [VENV=/tmp/triton36] [LOG_DIR=/tmp/triton_compat]
# Prints one line per (triton version, check): passed / failed counts and wall seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/triton36}
logs=${2:-/tmp/triton_compat}
mkdir -p "$logs"

if [ ! -x "$venv/bin/python" ]; then
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q triton==3.6.0 pytest ml-dtypes numpy rich
fi
# What the kernel tests import besides torch and triton (oracles, presets, the runtime's loaders).
"$venv/bin/pip" install -q scipy hydra-core==1.3.8 safetensors gguf tokenizers
numpy23=$venv-numpy23
[ -d "$numpy23/numpy" ] || "$venv/bin/pip" install -q --target "$numpy23" "numpy<2.4"

run_check() { # $1 python, $2 label, $3 check name, then the pytest arguments; $EXTRA_PATH
    local python=$1 label=$2 name=$3
    shift 3
    local begin=$SECONDS
    MLFLOW_DISABLE_TELEMETRY=true PYTHONPATH=${EXTRA_PATH:-}$PWD \
        "$python" -m pytest -q -p no:cacheprovider \
        "$@" >"$logs/$label-$name.log" 2>&1
    local rc=$? summary numpy
    summary=$(tail -n 1 "$logs/$label-$name.log")
    numpy=$(PYTHONPATH=${EXTRA_PATH:-} "$python" -c "import numpy; print(numpy.__version__)")
    echo "$label numpy-$numpy $name: rc=$rc, $summary, $((SECONDS - begin)) s"
}

for python in "$venv/bin/python" .venv/bin/python; do
    version=$("$python" -c "import triton; print(triton.__version__)")
    label=triton-$version
    # The compile check removes TRITON_INTERPRET itself (it runs in a child process).
    TRITON_INTERPRET=1 run_check "$python" "$label" interpreter tests/kernels \
        --deselect tests/kernels/formats/test_quantize.py::test_kernels_compile_for_cuda
    run_check "$python" "$label" sm90-compile \
        tests/kernels/formats/test_quantize.py::test_kernels_compile_for_cuda
done
EXTRA_PATH=$numpy23: TRITON_INTERPRET=1 run_check "$venv/bin/python" triton-3.6.0-numpy23 \
    interpreter tests/kernels --deselect tests/kernels/formats/test_quantize.py::test_kernels_compile_for_cuda
echo "logs: $logs"
