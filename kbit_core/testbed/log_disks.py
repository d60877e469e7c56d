"""Each bed broker's log directory on a small filesystem of its own (``kbit cluster up --log-disk-mb N``): a
size-limited tmpfs mounted on it before the broker formats it, which a fault fills and frees. `down` unmounts every
such filesystem, also after a crash, by the source name the mounts carry in /proc/mounts.

A tmpfs, not a loop-mounted ext4 image: both answer a write past the end with ENOSPC, but ext4's ``lost+found``
makes Kafka refuse the directory at start ("'lost+found' is not in the form of topic-partition"), and a loop
device is a machine-wide resource a crash would leak.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from kbit_core.brokers.apache_broker import ApacheKafkaBroker
from kbit_core.testbed.network import TestbedError

# The mounts' source in /proc/mounts: how `down` finds them without the bed's state.
LOG_DISK_SOURCE = "kbit-bed-logdir"
# The file that fills a log filesystem: a plain file, which Kafka's log manager ignores (it loads directories).
FILLER = ".kbit-disk-filler"
_CHUNK = 1 << 20


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def mount_log_disks(brokers: Iterable[ApacheKafkaBroker], size_mb: int) -> None:
    """A fresh ``size_mb`` MiB tmpfs on each broker's log directory (made empty: the broker formats it)."""
    for broker in brokers:
        broker.data_dir.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", LOG_DISK_SOURCE, str(broker.data_dir))


def log_disk_mounts() -> list[Path]:
    """The mount points of the bed's log filesystems, deepest first."""
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, point, *_ = line.split(" ")
        if source == LOG_DISK_SOURCE:  # /proc/mounts escapes a space in a path as \040
            points.append(Path(point.encode().decode("unicode_escape")))
    return sorted(set(points), key=lambda p: len(p.parts), reverse=True)


def unmount_log_disks(under: Path | None = None) -> list[str]:
    """Unmount every log filesystem of the bed (those below ``under`` only, given one), lazily where something still
    holds one open; what was removed."""
    removed = []
    for point in log_disk_mounts():
        if under is not None and not point.is_relative_to(Path(under).resolve()):
            continue
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            _run("umount", "--lazy", str(point))
        removed.append(f"log filesystem {point}")
    return removed


def require_log_disk(broker: ApacheKafkaBroker) -> None:
    if broker.data_dir.resolve() not in log_disk_mounts():
        raise TestbedError(
            f"the log directory of {broker.service.name} ({broker.data_dir}) is not a filesystem of its own: "
            "bring the bed up with `kbit cluster up --log-disk-mb N`"
        )


def free_bytes(broker: ApacheKafkaBroker) -> int:
    stat = os.statvfs(broker.data_dir)
    return stat.f_bavail * stat.f_frsize


def fill(broker: ApacheKafkaBroker) -> int:
    """Take every free byte of the broker's log filesystem (reserved at once, then written up to ENOSPC); the bytes
    taken. Kafka's next write past its last block then fails with "No space left on device"."""
    require_log_disk(broker)
    path = broker.data_dir / FILLER
    with open(path, "ab", buffering=0) as filler:
        try:
            os.posix_fallocate(filler.fileno(), os.fstat(filler.fileno()).st_size, max(1, free_bytes(broker)))
        except OSError:  # ENOSPC: less was free than statvfs said; the writes below take the rest
            pass
        try:
            while filler.write(bytes(_CHUNK)):
                pass
        except OSError:  # ENOSPC: full
            pass
    return path.stat().st_size


def free(broker: ApacheKafkaBroker) -> int:
    """Remove the filler; the bytes free afterwards."""
    (broker.data_dir / FILLER).unlink(missing_ok=True)
    return free_bytes(broker)
