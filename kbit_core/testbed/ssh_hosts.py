"""SSH on the bed's node hosts, as Ray's cluster launcher needs it: an sshd per node on its bed address only, host keys
and a client key pair of kbit's own, and a home directory per host (the bed's hosts share one filesystem).

Everything lives under ``<bed>/ssh`` (keys, mode 0600) and ``<bed>/run/hosts/<node>`` (the host's home and Ray's
directory), reached through a short link in /tmp (:func:`short_root`): Ray puts its sockets under its temp directory
and a Unix socket path may not exceed 107 bytes, which a pytest directory would. A session on a node host gets the
bed's marker variable (so `kbit cluster down` finds whatever it started) and its host's name in ``KBIT_BED_HOST``,
and root's home is the host's own there (:func:`sshd_service`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kbit_core import ray_env
from kbit_core.service import Service
from kbit_core.testbed.network import Host, TestbedError, in_host

SSHD = "/usr/sbin/sshd"
SSH_USER = "root"  # the bed runs as root; a host of a team's would name a user of its own
HOST_VARIABLE = "KBIT_BED_HOST"
# sshd's privilege separation directory; Debian's service unit makes it, a bare `sshd -D` needs it to exist
PRIVSEP_DIR = Path("/run/sshd")


def missing_prerequisites() -> list[str]:
    """What Ray's cluster launcher on the bed needs and this machine lacks (sshd, ssh, ssh-keygen, rsync)."""
    tools = {"sshd": SSHD, "ssh": "ssh", "ssh-keygen": "ssh-keygen", "rsync": "rsync"}
    missing = [name for name, tool in tools.items() if shutil.which(tool) is None]
    return [f"the `{', '.join(missing)}` command(s) (apt-get install openssh-server rsync)"] if missing else []


def ssh_dir(bed_dir: Path) -> Path:
    return Path(bed_dir) / "ssh"


def client_key(bed_dir: Path) -> Path:
    """kbit's private key, authorized on every node host for :data:`SSH_USER`."""
    return ssh_dir(bed_dir) / "kbit_ed25519"


def short_root(bed_dir: Path) -> Path:
    """A short path in /tmp, linked to ``<bed>/run/hosts``, for the hosts' homes and Ray's directories."""
    digest = hashlib.sha256(str(Path(bed_dir).resolve()).encode()).hexdigest()[:8]
    return Path("/tmp") / f"kbit-bed-{digest}"


def host_home(bed_dir: Path, node: Host) -> Path:
    return short_root(bed_dir) / node.name / "home"


def ray_tmpdir(bed_dir: Path, node: Host) -> Path:
    """RAY_TMPDIR on ``node``: Ray keeps its sessions, sockets and logs in ``<this>/ray``."""
    return short_root(bed_dir) / node.name


def make_keys(bed_dir: Path) -> None:
    """The sshd host key and kbit's client key pair (kept across `up`s, like the certificates); mode 0600."""
    keys = ssh_dir(bed_dir)
    keys.mkdir(parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    for key in (keys / "host_ed25519_key", client_key(bed_dir)):
        if not key.is_file():
            done = subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"kbit-bed {key.name}", "-f", str(key)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise TestbedError(f"ssh-keygen could not make {key}: {done.stderr.strip()}")
        os.chmod(key, 0o600)
    authorized = keys / "authorized_keys"
    authorized.write_text(client_key(bed_dir).with_suffix(".pub").read_text())
    os.chmod(authorized, 0o600)


def start(bed_dir: Path, sshds: list[Service], timeout_s: float) -> None:
    """The keys, the hosts' homes, then an sshd on each node host."""
    make_keys(bed_dir)
    link_short_root(bed_dir)
    for sshd in sshds:
        sshd.start(timeout_s=timeout_s)


def link_short_root(bed_dir: Path) -> None:
    target = Path(bed_dir).resolve() / "run" / "hosts"
    target.mkdir(parents=True, exist_ok=True)
    link = short_root(bed_dir)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def unlink_short_root(bed_dir: Path) -> list[str]:
    link = short_root(bed_dir)
    if not link.is_symlink():
        return []
    link.unlink()
    return [f"link {link}"]


def _sshd_config(bed_dir: Path, node: Host, port: int, marker_env: dict[str, str]) -> str:
    keys = ssh_dir(bed_dir)
    env = {HOST_VARIABLE: node.name, **marker_env}
    return "\n".join(
        [
            f"ListenAddress {node.address}:{port}",
            f"HostKey {keys / 'host_ed25519_key'}",
            f"AuthorizedKeysFile {keys / 'authorized_keys'}",
            f"PidFile {Path(bed_dir) / 'run' / f'sshd-{node.name}.sshd-pid'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # StrictModes checks every directory above the key files, and /tmp (1777) fails it; the key files
            # themselves are 0600 in a 0700 directory
            "StrictModes no",
            "X11Forwarding no",
            "PrintMotd no",
            "SetEnv " + " ".join(f"{name}={value}" for name, value in env.items()),
        ]
    )


def _bashrc(bed_dir: Path, node: Host) -> str:
    """The host's shell setup, as a machine image would have it: Python with Ray and kbit on PATH, Ray's environment
    (its token where the cluster launcher's file_mounts put it) and a `ray stop` that stops this host's Ray only."""
    env = {
        **ray_env.ray_env(None, loopback=False),
        **ray_env.HEAD_ENV,
        "RAY_AUTH_TOKEN_PATH": "$HOME/kbit/auth_token",
        "RAY_TMPDIR": str(ray_tmpdir(bed_dir, node)),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    return "\n".join(
        [
            "# written by `kbit cluster up` (kbit_core/testbed/ssh_hosts.py)",
            f'export PATH="{Path(sys.executable).parent}:$PATH"',
            *(f'export {name}="{value}"' for name, value in env.items()),
            # The bed's hosts share one process table, and Ray's own `ray stop` (which `ray down` runs on the head)
            # stops every Ray process on the machine (ray-project/ray#11513): this host's processes only, here.
            'ray() { if [ "$1" = stop ]; then python -m kbit_core.testbed.ray_node_stop; else command ray "$@"; fi; }',
            "",
        ]
    )


def _passwd_with_home(passwd: str, user: str, home: Path) -> str:
    """/etc/passwd's text with ``user``'s home directory replaced by ``home``."""
    lines = []
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) == 7 and fields[0] == user:
            fields[5] = str(home)
        lines.append(":".join(fields))
    return "\n".join(lines) + "\n"


def sshd_service(bed_dir: Path, run_dir: Path, node: Host, port: int, marker_env: dict[str, str]) -> Service:
    """An sshd on ``node``'s bed address only; its sessions start in the host's home."""
    config, passwd = run_dir / f"sshd-{node.name}.conf", run_dir / f"passwd-{node.name}"

    def prepare() -> None:
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        config.write_text(_sshd_config(bed_dir, node, port, marker_env) + "\n")
        home = host_home(bed_dir, node)
        home.mkdir(parents=True, exist_ok=True)
        (home / ".bashrc").write_text(_bashrc(bed_dir, node))
        passwd.write_text(_passwd_with_home(Path("/etc/passwd").read_text(), SSH_USER, home))
        os.chmod(passwd, 0o644)

    return Service(
        f"sshd-{node.name}",
        run_dir,
        # `ip netns exec` gives the sshd a mount namespace of its own: there, and only there, /etc/passwd names the
        # host's home for root, so sessions get HOME, and ssh's and rsync's `~` (which ssh takes from passwd, not
        # from HOME: the head's autoscaler reaches the workers with `-i ~/ray_bootstrap_key.pem`) is this host's
        in_host(
            node,
            [
                "sh",
                "-c",
                'mount --bind "$0" /etc/passwd && exec "$@"',
                str(passwd),
                SSHD,
                "-D",
                "-e",
                "-f",
                str(config),
            ],
        ),
        marker=SSHD,
        env=marker_env,
        prepare=prepare,
        host=node.address,
        port=port,
        error_type=TestbedError,
    )
