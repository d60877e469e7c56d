"""scripts/suite.sh, the test command's two pytest sessions side by side: which session runs which tests, each in a
TMPDIR of its own with its lines prefixed, one session for tests named on the command line, and the exit status of
the two together. pytest is a stand-in here that records its arguments and exits as told."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

BESIDE = ["tests/testbed", "tests/ray", "tests/faults", "tests/integration/test_readme_commands.py", "tests/unit"]
STAND_IN = """#!/usr/bin/env bash
echo "$(basename "$TMPDIR") $*" >> "$CALLS"
echo "collected something"
case " $* " in *" tests/testbed "*) exit "$BED_RC" ;; *) exit "$REST_RC" ;; esac
"""


def run_suite(tmp_path: Path, *args: str, rest: int = 0, bed: int = 0) -> tuple[int, str, list[str]]:
    """``run_suite args`` with pytest's stand-in: its exit status, its output and the stand-in's calls (each: the
    session's TMPDIR name, then its arguments)."""
    venv_bin, root = tmp_path / "venv" / "bin", tmp_path / "suite-tmp"
    venv_bin.mkdir(parents=True)
    root.mkdir()
    (venv_bin / "python").write_text(STAND_IN)
    (venv_bin / "python").chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "VENV": str(tmp_path / "venv"),
        "TMPDIR": str(root),
        "CALLS": str(calls),
        "REST_RC": str(rest),
        "BED_RC": str(bed),
    }
    done = subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source scripts/suite.sh; run_suite "$@"', "suite", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr, sorted(calls.read_text().splitlines())


def test_the_suite_runs_as_two_sessions_each_with_its_own_tmpdir_and_prefix(tmp_path: Path) -> None:
    rc, output, calls = run_suite(tmp_path, "--durations=60", "-k", "not gpu")
    ignored = " ".join(f"--ignore={path}" for path in BESIDE)
    assert calls == [
        f"bed -m pytest --durations=60 -k not gpu {' '.join(BESIDE)}",
        f"rest -m pytest --durations=60 -k not gpu {ignored}",
    ]
    assert rc == 0
    assert sorted(output.splitlines()) == ["[bed] collected something", "[rest] collected something"]
    assert sorted(p.name for p in (tmp_path / "suite-tmp").iterdir()) == ["bed", "rest"]


@pytest.mark.parametrize("named", ["tests/unit/test_config.py", "tests", "tests/integration/test_reader.py::test_x"])
def test_tests_named_on_the_command_line_run_in_one_session(tmp_path: Path, named: str) -> None:
    rc, output, calls = run_suite(tmp_path, "-x", named, rest=1)
    assert calls == [f"suite-tmp -m pytest -x {named}"]
    assert (rc, output) == (1, "collected something\n")


@pytest.mark.parametrize(
    ("rest", "bed", "expected"),
    [(0, 0, 0), (5, 0, 0), (0, 5, 0), (1, 0, 1), (0, 1, 1), (5, 2, 2), (2, 1, 2), (5, 5, 1)],
)
def test_the_exit_status_fails_when_either_session_fails_or_neither_collects(
    tmp_path: Path, rest: int, bed: int, expected: int
) -> None:
    rc, output, _ = run_suite(tmp_path, rest=rest, bed=bed)
    assert rc == expected
    assert ("kbit: pytest collected no tests" in output) == (rest == bed == 5)
