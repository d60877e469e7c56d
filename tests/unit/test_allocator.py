"""kbit_core.data.allocator in fresh processes: the reader's setting keeps a freed block in the resident set for the
next one; the benchmark's hands it back at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# In a fresh process: the setting named by argv[1], then a 16 MiB block written, freed; the resident set (MiB) before
# the block, with it, and after it was freed.
PROBE = """
import json, os, sys
from kbit_core.data import allocator

def resident_mb():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

took = allocator.keep_freed_memory() if sys.argv[1] == "keep" else allocator.unmap_freed_blocks(64 * 1024)
before = resident_mb()
block = bytearray(16 * 2**20)
block[:] = b"x" * len(block)
held = resident_mb()
del block
print(json.dumps({"took": took, "held": held - before, "after": resident_mb() - before}))
"""


def probe(setting: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(("setting", "kept"), [("keep", True), ("unmap", False)])
def test_a_freed_block_stays_resident_only_with_the_readers_setting(setting: str, kept: bool) -> None:
    measured = probe(setting)
    assert measured["took"] is True and measured["held"] > 15
    assert (measured["after"] > 15) is kept and (measured["after"] < 1) is not kept
