"""Fault-injection fixtures: run the real `kbit` command against the real broker and record how it ends.

Every scenario asserts the exact outcome (exit code, error type and text, what is left behind) and records its
time to fail as the ``seconds`` property in pytest's JUnit XML, which docs/reliability.md tabulates.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

KBIT = Path(sys.executable).parent / "kbit"


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def error(self) -> str:
        """The ``error:`` line the CLI printed (its whole message, without the prefix)."""
        lines = [line for line in self.stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, f"expected one error line, got:\n{self.stderr[-3000:]}"
        return lines[0].removeprefix("error: ")


@pytest.fixture
def kbit_tmpdir(tmp_path: Path) -> Path:
    """The TMPDIR the command runs with, so a scenario can assert it left nothing there."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    return tmp


@pytest.fixture
def run_kbit(
    tmp_path: Path, kbit_tmpdir: Path, record_property: Callable[[str, object], None]
) -> Callable[..., Outcome]:
    """``run_kbit(*args, timeout=120)``: the `kbit` command in ``tmp_path``, timed; stdin closed."""

    def run(*args: str, timeout: float = 120) -> Outcome:
        started = time.monotonic()
        done = subprocess.run(
            [str(KBIT), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(kbit_tmpdir)},
        )
        seconds = time.monotonic() - started
        record_property("seconds", round(seconds, 2))
        return Outcome(done.returncode, done.stdout, done.stderr, seconds)

    return run


def assert_failed_cleanly(outcome: Outcome, tmpdir: Path) -> None:
    """Exit code 1, no traceback (that is for --debug), nothing left in TMPDIR."""
    assert outcome.returncode == 1, outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-3000:]
    assert list(tmpdir.iterdir()) == [], "the failed command left temporary files"
