"""What a SIGKILLed driver leaves behind (issue 21 defect 11) is found by the next run: its owner is gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kbit_core.launch import distributor
from kbit_core.launch.spark import spark_dir
from kbit_core.service import owner_gone, owner_token


def a_gone_owner() -> str:
    """The owner token of a process that has ended, as a SIGKILLed driver has."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    token = owner_token(child.pid)
    child.kill()
    child.wait()
    return token


def test_an_owner_is_gone_once_its_process_ended_and_never_while_it_runs() -> None:
    assert owner_gone(a_gone_owner())
    assert not owner_gone(owner_token())
    assert not owner_gone("another-host:1:0.00") and not owner_gone("not a token")


def test_a_run_directory_of_a_gone_driver_is_removed_by_the_next_run(tmp_path: Path) -> None:
    runs = spark_dir(tmp_path)
    abandoned, live, legacy = runs / "run-dead0001", runs / "run-live0001", runs / "run-old00001"
    for directory, owner in ((abandoned, a_gone_owner()), (live, owner_token()), (legacy, None)):
        (directory / "torchelastic_x").mkdir(parents=True)
        if owner is not None:
            (directory / distributor.RUN_OWNER_FILE).write_text(owner)
    with distributor._run_tmpdir(tmp_path) as mine:
        assert (mine / distributor.RUN_OWNER_FILE).read_text() == owner_token()
        assert sorted(p.name for p in runs.iterdir()) == sorted([live.name, legacy.name, mine.name])
    assert not mine.exists()
