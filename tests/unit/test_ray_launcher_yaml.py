"""deployments/ray/cluster.yaml rendered for the test bed: the bed's addresses, kbit's SSH key and the bed's token,
and a config Ray 2.60's own launcher accepts (its schema, then the local provider's preparation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kbit_core.testbed import ray_launcher
from kbit_core.testbed.network import TestbedError, Topology


def test_the_bed_cluster_yaml_points_at_the_bed_and_ray_accepts_it(tmp_path: Path):
    topology = Topology.build("10.213.7.0/24", 3)
    rendered = ray_launcher.render(tmp_path / "testbed", topology, tmp_path / "token")
    assert rendered == ray_launcher.cluster_yaml_path(tmp_path / "testbed")
    config = yaml.safe_load(rendered.read_text())
    assert config["provider"] == {
        "type": "local",
        "head_ip": "10.213.7.11",
        "worker_ips": ["10.213.7.12", "10.213.7.13"],
    }
    assert config["auth"] == {"ssh_user": "root", "ssh_private_key": str(tmp_path / "testbed" / "ssh" / "kbit_ed25519")}
    assert config["file_mounts"] == {ray_launcher.TOKEN_MOUNT: str(tmp_path / "token")}
    assert (config["min_workers"], config["max_workers"]) == (0, 1)  # the autoscaler has a worker to add

    pytest.importorskip("ray")
    from ray.autoscaler._private.local.config import LOCAL_CLUSTER_NODE_TYPE
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(
        config
    )  # what `ray up` does with it, and writes to the head's ~/ray_bootstrap_config.yaml
    validate_config(prepared)
    node_type = prepared["available_node_types"][LOCAL_CLUSTER_NODE_TYPE]
    assert (node_type["min_workers"], node_type["max_workers"]) == (0, 1)
    # the head's autoscaler prepares that file once more: unchanged (Ray before PR #60184 refused it there, so no
    # worker ever started: ray-project/ray#59905)
    assert prepare_config(prepared) == prepared


def test_a_bed_of_one_node_host_has_no_worker_for_the_launcher(tmp_path: Path):
    with pytest.raises(TestbedError, match="needs a worker host"):
        ray_launcher.render(tmp_path, Topology.build("10.213.7.0/24", 1), tmp_path / "token")
