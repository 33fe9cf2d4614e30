"""Freed decode temporaries stay in the process once an engine exists: checked on the kernel's
resident-set count in fresh processes, against a fresh process without an engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Prints the share of a 256 MiB tensor (above glibc's largest default mmap threshold, 32 MiB)
# whose pages stay resident when it is freed (it may reuse pages the setup freed before).
PROBE = """
import os, torch
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
size = 256 << 20
buffer = torch.ones(size // 4)
held = resident()
del buffer
print(1 - (held - resident()) / size)
"""
ENGINE = """
from kvtune.runtime import LLM, KVPolicy
LLM("smollm2-135m", policy=KVPolicy("auto", "auto"), max_model_len=64)
"""


def kept_share(setup: str) -> float:
    result = subprocess.run([sys.executable, "-c", setup + PROBE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return float(result.stdout.split()[-1])


def test_without_an_engine_a_freed_buffer_leaves_the_process() -> None:
    assert kept_share("") < 0.1


def test_with_an_engine_a_freed_buffer_stays_for_the_next_step() -> None:
    assert kept_share(ENGINE) > 0.9
