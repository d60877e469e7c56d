"""Keeps the memory a reader frees for its next block: with glibc's default thresholds a block's bytes (the fetched
values, their join, the decoded columns: megabytes each) are mapped fresh and handed back to the kernel when freed,
so every page of the next block faults in again on first touch, about one fault per 5 records of 794 bytes."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (<malloc.h>)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to glibc's own ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) come from the heap,
# and up to twice that stays free at its top: the rule glibc applies itself when it raises the threshold on its own,
# which setting either value turns off.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: allocations up to :data:`MMAP_THRESHOLD_BYTES` from malloc's heap, and up to
    :data:`TRIM_THRESHOLD_BYTES` of freed memory kept there for the next ones. Whether it took effect: False where
    the C library has no glibc ``mallopt`` (the process then runs with its allocator's defaults)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this process's C library: freed memory goes back to the kernel")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt answers 1 on success, 0 on a value it refuses (musl's stub refuses every one)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
