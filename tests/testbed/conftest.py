"""The multi-host test bed for the tests that need several hosts: one bed per session, skipped where it cannot run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kbit_core import ray_env
from kbit_core import testbed as bed
from kbit_core.testbed import BedOptions, BedState
from tests.conftest import unavailable

# Each broker's log directory on a filesystem of its own (test_disk_faults.py fills one): ample for the suite's topics.
LOG_DISK_MB = 256
HERE = Path(__file__).resolve().parent
# Beside a bed this session brought up itself: its pytest's process id. Only such a bed may be re-created (a bed a
# shell brought up keeps its topics). A file, not a module variable: conftest may be imported under two names.
SESSION_MARK = "pytest-session.pid"


def started_by_this_session(state: BedState) -> bool:
    mark = Path(state.bed_dir).parent / SESSION_MARK
    return mark.is_file() and mark.read_text() == str(os.getpid())


@pytest.fixture(scope="session")
def testbed() -> Iterator[BedState]:
    """The bed's state: master URL, broker bootstrap, CA and client certificate, hosts (``state.kafka_overrides()``).

    A bed that is already up (`kbit cluster up` in a shell) is used as it is and left running;
    otherwise the session brings one up and takes it down after its last bed test.
    """
    missing = bed.missing_prerequisites()
    if missing:
        unavailable("the multi-host test bed cannot run here; missing: " + "; ".join(missing))
    running = bed.running_bed_dir()
    if running is not None and bed.status(running).up:
        state = bed.load_state(running)
        assert state is not None
        yield state
        return
    # `<workdir>/testbed`, as the CLI places it; not under pytest's mode-0700 tmp folder: as root the team stack's
    # PostgreSQL (test_bed_team_stack.py) runs as the `postgres` user, who must enter every directory above its data
    workdir = Path(tempfile.mkdtemp(prefix="kbit-testbed-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    bed_dir = workdir / "testbed"
    (workdir / SESSION_MARK).write_text(str(os.getpid()))
    _take_down.append(lambda: _down_and_remove(bed_dir, workdir))
    yield bring_up(bed_dir, BedOptions(log_disk_mb=LOG_DISK_MB))
    take_the_bed_down()


# How to take down the bed this session brought up, until it is down. The fixture is the session's (a directory
# without __init__.py has no package scope), but the bed goes down after the session's last bed test: its idle
# brokers, Spark and Ray nodes took 17.5 % of a core, which the tests after it (the other session's too) need.
_take_down: list[Callable[[], None]] = []


def _down_and_remove(bed_dir: Path, workdir: Path) -> None:
    bed.down(bed_dir)
    shutil.rmtree(workdir, ignore_errors=True)


def take_the_bed_down() -> None:
    while _take_down:
        _take_down.pop()()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After this directory's last test in the session's order (pytest may regroup items by parameter) and its
    fixtures' teardown, which may still use the bed, the bed goes down."""
    yield
    if nextitem is not None and HERE in nextitem.path.parents:
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any(HERE in test.path.parents for test in later):
        take_the_bed_down()


def bring_up(bed_dir: Path, options: BedOptions) -> BedState:
    """`bed.up` as the session does it."""
    with pytest.MonkeyPatch.context() as patch:
        # As in a driver whose environment a local Ray runtime already set (the suite's Ray tests, wherever they run):
        # it turns Ray's multi-node mode off, which the bed's Ray nodes must not inherit.
        for name, value in ray_env.ray_env(None, loopback=True).items():
            patch.setenv(name, value)
        return bed.up(bed_dir, options)


@contextmanager
def links_restored(testbed: BedState, why: str) -> Iterator[BedState]:
    """The bed, with nft available (``why`` needs it); afterwards its links are shaped as they were before."""
    if shutil.which("nft") is None:
        unavailable(f"{why} need the `nft` command (apt-get install nftables)")
    link = testbed.options.get("link")
    try:
        yield testbed
    finally:
        bed.reshape(testbed.bed_dir, link)
