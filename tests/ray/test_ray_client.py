"""Ray Client (`launch.ray_address: ray://host:port`) on the session's real Ray head: a training run through the
client server on 127.0.0.1, nothing of the head listening beyond loopback, and an address nobody serves refused at once.
"""

from __future__ import annotations

import json
import socket

import psutil
import pytest

from kbit_core.config import KbitConfig, is_loopback
from kbit_core.errors import ConfigError
from kbit_core.launch import launch
from kbit_core.ray_env import own_token_file
from kbit_core.service import Service
from kbit_core.stack import StackError, ray_head
from tests.conftest import free_port
from tests.ray.engine_entries import rank_sample_indices
from tests.ray.test_ray_engine import listening_sockets, train_ray_profile

pytestmark = [pytest.mark.kafka, pytest.mark.ray]


@pytest.mark.slow
def test_training_through_ray_client_runs_its_ranks_on_the_head(
    broker, ray_head_config: KbitConfig, ray_head_service: Service, tmp_path, topic_name
):
    client_address = f"ray://127.0.0.1:{ray_head_config.launch.ray_client_server_port}"
    sets = {
        "workdir": tmp_path / "kbit",
        "kafka.embedded.port": broker.port,
        "produce.topic": topic_name,
        "launch.ray_address": client_address,
        "dataset.num_records": 2000,
        "train.epochs": 1,
        "tracking.enabled": "false",
        "launch.ray_auth_token_file": own_token_file(ray_head_config.run_dir),
    }
    # A process of its own: this one may already be a driver of the head, and a process joins one cluster once.
    done = train_ray_profile(sets)
    assert done.returncode == 0, done.stderr[-4000:]
    # Ray took the client path: only Ray Client hands ray.init's arguments to a server
    assert "Passing the following kwargs to ray.init() on the server" in done.stderr
    result = json.loads(done.stdout)
    assert result["world_size"] == 2 and result["engine"] == "ddp" and result["steps"] == 25
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert {r["address"] for r in result["ranks"]} == {"127.0.0.1"}, result["ranks"]
    # the client server and the per-client server it started for this run stay on loopback with the rest of the head
    sockets = listening_sockets(psutil.Process(ray_head_service.pid()))
    assert ray_head_config.launch.ray_client_server_port in {addr.port for _, addr in sockets}, sockets
    exposed = [(name, addr) for name, addr in sockets if not is_loopback(addr.ip.removeprefix("::ffff:"))]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"


def test_a_client_server_port_taken_by_another_process_stops_the_head_from_starting(tmp_path):
    # Before, a second head on one machine came up with Ray's client server failing on Ray's default port
    cfg = KbitConfig.from_dict(
        {
            "workdir": str(tmp_path),
            "launch": {"engine": "ray", "ray_head_port": free_port(), "ray_client_server_port": free_port()},
        }
    )
    head = ray_head(cfg)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", cfg.launch.ray_client_server_port))
        squatter.listen()
        with pytest.raises(
            StackError,
            match=rf"port 127.0.0.1:{cfg.launch.ray_client_server_port} is already taken"
            r".*launch.ray_client_server_port",
        ):
            head.start()
    assert head.pid() is None and not head.pid_path.exists()


def test_a_client_address_nobody_serves_is_refused_within_seconds(make_config, topic_name):
    address = f"ray://127.0.0.1:{free_port()}"
    cfg = make_config(produce__topic=topic_name, launch={"engine": "ray", "ray_address": address})
    # Ray's own client would retry for about 30 s and then raise a ConnectionError blaming the network
    with pytest.raises(ConfigError) as info:
        launch(rank_sample_indices, cfg, "{}")
    assert f"launch.ray_address={address}" in str(info.value)
    assert "--ray-client-server-port" in str(info.value) and "launch.ray_client_server_port" in str(info.value)
