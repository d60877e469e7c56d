"""Ray's own cluster launcher on the bed: `deployments/ray/cluster.yaml` rendered for this bed (its node addresses, its
SSH key, its Ray token), and the environment `ray up | exec | down` run with on the driver host.

kbit starts no Ray process for this cluster: `ray up` reaches the head over SSH (:mod:`kbit_core.testbed.ssh_hosts`),
and the head's autoscaler reaches the workers the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kbit_core.testbed.network import TestbedError, Topology
from kbit_core.testbed.ssh_hosts import SSH_USER, client_key, short_root

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "deployments" / "ray" / "cluster.yaml"
TOKEN_MOUNT = "~/kbit/auth_token"  # where file_mounts puts the Ray token on each node (the hosts' ~/.bashrc reads it)


def cluster_yaml_path(bed_dir: Path) -> Path:
    """The rendered cluster.yaml of the bed that runs from ``bed_dir`` (gone with `kbit cluster down`)."""
    return Path(bed_dir) / "run" / "ray-cluster.yaml"


def render(bed_dir: Path, topology: Topology, token_file: Path, template: Path = CLUSTER_YAML) -> Path:
    """Write the bed's cluster.yaml: head on the first node host, the others as workers, kbit's key, the bed's token."""
    try:
        config: dict[str, Any] = yaml.safe_load(template.read_text())
        head, *workers = topology.nodes
        config["provider"].update(head_ip=head.address, worker_ips=[w.address for w in workers])
        config["auth"].update(ssh_user=SSH_USER, ssh_private_key=str(client_key(bed_dir)))
        config["file_mounts"][TOKEN_MOUNT] = str(token_file)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:
        raise TestbedError(f"{template}: not a cluster.yaml kbit can point at the bed ({exc})") from exc
    if not workers:
        raise TestbedError(
            "Ray's cluster launcher on the bed needs a worker host: bring the bed up with --nodes 2 or more"
        )
    config["max_workers"] = min(config.get("max_workers", len(workers)), len(workers))
    out = cluster_yaml_path(bed_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# rendered by `kbit cluster up` from {template}\n" + yaml.safe_dump(config, sort_keys=False))
    return out


def launcher_env(bed_dir: Path) -> dict[str, str]:
    """Where `ray up | exec | down` on the driver host keep their files (cluster state, config cache): the bed's, not
    /tmp/ray or ~. Ray's SSH control sockets stay in /tmp/ray_ssh_* (fixed in Ray)."""
    launcher = short_root(bed_dir) / "launcher"
    (launcher / "home").mkdir(parents=True, exist_ok=True)
    return {
        "RAY_TMPDIR": str(launcher),
        "TMPDIR": str(launcher),
        "HOME": str(launcher / "home"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
