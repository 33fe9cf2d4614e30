"""Test-wide environment: set before any kernel module is imported.

TRITON_INTERPRET=1 makes Triton kernels run on the CPU (no GPU here); it must be set before
`triton.jit` decorates anything, which is why it lives at the top of the root conftest.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
