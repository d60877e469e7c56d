"""A rank's progress output after its reader is gone: the rank goes on (to its final checkpoint) in silence."""

from __future__ import annotations

import os

from kbit_core.train.loop import RankConsole


def _closed_pipe():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    return open(write_fd, "w")


def test_a_rank_console_whose_reader_is_gone_goes_quiet_and_keeps_running():
    # rich's own Console raises SystemExit(1) here (after pointing this process's stdout at /dev/null)
    with _closed_pipe() as pipe:
        console = RankConsole(file=pipe)
        console.print("step 1")
        console.print("step 2")
        assert console.quiet
        pipe.write("the stream itself now writes to /dev/null\n")
        pipe.flush()
