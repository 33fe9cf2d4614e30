"""Test-wide environment: set before any kernel module is imported.

KVTUNE_TEST_DEVICE picks where the kernel and engine tests run: `cpu` (the default) runs the
Triton kernels under TRITON_INTERPRET=1, which must be set before `triton.jit` decorates
anything, which is why it lives at the top of the root conftest; `cuda` (a GPU machine,
benchmarks/gpu_check.sh) runs them compiled, with tests/kernels/conftest.py placing test data
on the GPU.
"""

import os

import pytest

TEST_DEVICES = ("cpu", "cuda")
TEST_DEVICE = os.environ.get("KVTUNE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in TEST_DEVICES:
    raise pytest.UsageError(f"KVTUNE_TEST_DEVICE={TEST_DEVICE!r}: one of {', '.join(TEST_DEVICES)}")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("TRITON_INTERPRET", "0") != "0":
    raise pytest.UsageError("KVTUNE_TEST_DEVICE=cuda runs compiled kernels: unset TRITON_INTERPRET")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
