"""glibc's malloc thresholds, set for one of two ends: a reader keeping the memory it frees for its next block, or a
memory benchmark handing each freed block back at once, so that its resident set follows what it holds.

With glibc's defaults a reader's block (the fetched values, their join, the decoded columns: megabytes each) is mapped
fresh and handed back to the kernel when freed, so every page of the next block faults in again on first touch,
about one fault per 5 records of 794 bytes. A benchmark measuring peak memory needs the opposite: the heap's own
keeping of freed blocks in the resident set is noise to it."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt's parameters (<malloc.h>)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to glibc's own ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX) come from the heap,
# and up to twice that stays free at its top: the rule glibc applies itself when it raises the threshold on its own,
# which setting either value turns off.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where this process's C library has none."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: allocations up to :data:`MMAP_THRESHOLD_BYTES` from malloc's heap, and up to
    :data:`TRIM_THRESHOLD_BYTES` of freed memory kept there for the next ones. Whether it took effect: False where
    the C library has no glibc ``mallopt`` (the process then runs with its allocator's defaults)."""
    mallopt = _mallopt()
    if mallopt is None:
        log.debug("no mallopt in this process's C library: freed memory goes back to the kernel")
        return False
    # mallopt answers 1 on success, 0 on a value it refuses (musl's stub refuses every one)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def unmap_freed_blocks(from_bytes: int) -> bool:
    """Every later allocation of ``from_bytes`` or more mapped on its own, and so unmapped when freed. Whether it took
    effect (False without glibc's ``mallopt``)."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, from_bytes))
