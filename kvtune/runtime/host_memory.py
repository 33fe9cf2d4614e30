"""Keep freed host memory in the process from one decode step to the next (glibc).

A torch-path decode step allocates and frees multi-megabyte tensors in every layer (gathered
K/V, their concatenation). By default glibc hands such memory back to the kernel when it is
freed: blocks above the mmap threshold are unmapped, and a heap top above the trim threshold is
trimmed. The next step then faults the same pages in again. On a 2-core CPU that was 40% of a
batch-8 x 2048 decode step. Raising both thresholds keeps the memory in the heap, as vLLM's CPU
backend does by preloading tcmalloc. The price is that the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Freed memory the heap keeps, and the size from which blocks are mapped on their own.
KEPT_BYTES = 1 << 30


@functools.cache
def keep_freed_host_memory() -> bool:
    """Raise glibc's trim and mmap thresholds to KEPT_BYTES, once per process. False (nothing
    changed) where the C library has no mallopt or refuses either value (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    kept = mallopt(M_MMAP_THRESHOLD, KEPT_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEPT_BYTES) == 1
    if kept:
        logger.info("host memory: freed blocks below %d MiB stay in the heap", KEPT_BYTES >> 20)
    return kept
