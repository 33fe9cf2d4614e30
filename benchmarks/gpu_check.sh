#!/usr/bin/env bash
# The one device call (`run` tool of a lent H200): check and time the Triton kernels on the GPU.
# It uses the device image's python3 (torch + triton + rich are there); the results land in $OUT.
#   command: bash benchmarks/gpu_check.sh    (timeout_s 540 leaves room for one rerun)
set -euo pipefail
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"
# Decode attention: fp16 / fp8 / fp4 x CSA, batch 1/8/32 x 4K/32K/128K, with the kernels'
# relative error against the torch path on the same GPU tensors in the note column.
timeout 480 python3 -m benchmarks.kernels --device cuda 2>&1 | tee "$out/kernels.txt"
