"""Ray's environment is kbit's own: a token kbit creates (0600, never in ~/.ray), handed to what joins, refreshed in a
Ray imported before kbit set it, and a clear error where no token is known."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kbit_core import ray_env
from kbit_core.config import KbitConfig
from kbit_core.errors import ConfigError
from kbit_core.stack import ray_head
from kbit_core.testbed import ray_cluster
from kbit_core.testbed.network import Host


def test_the_token_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = ray_env.create_token(ray_env.own_token_file(tmp_path))

    token = path.read_text()
    assert path == tmp_path / "ray" / "auth_token"
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ray_env.create_token(path).read_text() == token, "an existing token is kept"


def test_an_empty_token_file_is_filled_and_made_private(tmp_path: Path) -> None:
    path = tmp_path / "auth_token"
    path.touch(mode=0o644)

    ray_env.create_token(path)

    assert len(path.read_text()) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_local_ray_keeps_loopback_and_a_cluster_does_not(tmp_path: Path) -> None:
    token = tmp_path / "t"
    local, cluster = ray_env.ray_env(token, loopback=True), ray_env.ray_env(token, loopback=False)

    assert local["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and cluster["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert local["RAY_AUTH_MODE"] == cluster["RAY_AUTH_MODE"] == "token"
    assert local["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert "RAY_AUTH_TOKEN_PATH" not in ray_env.ray_env(None, loopback=False), "None: the user's own variables"


def test_joining_takes_the_configured_token_file_then_the_stacks_then_kbits_own(tmp_path: Path) -> None:
    configured = ray_env.create_token(tmp_path / "theirs")
    recorded = ray_env.own_token_file(tmp_path / "stack")
    own = ray_env.own_token_file(tmp_path / "workdir")

    assert ray_env.join_token_file("10.0.0.1:6379", configured, recorded, own) == configured
    ray_env.create_token(own)
    assert ray_env.join_token_file("127.0.0.1:6390", None, recorded, own) == own, "a recorded file not there: own"
    ray_env.create_token(recorded)
    assert ray_env.join_token_file("127.0.0.1:6390", None, recorded, own) == recorded


def test_joining_without_any_token_names_the_setting_and_creates_none(tmp_path: Path) -> None:
    own = ray_env.own_token_file(tmp_path)

    with pytest.raises(ConfigError, match=r"Ray cluster at ray://10\.1\.2\.3:10001 .*launch\.ray_auth_token_file"):
        ray_env.join_token_file("ray://10.1.2.3:10001", None, None, own)
    with pytest.raises(ConfigError, match=rf"launch\.ray_auth_token_file={tmp_path / 'missing'}: no token there"):
        ray_env.join_token_file("ray://10.1.2.3:10001", tmp_path / "missing", None, own)
    assert not own.exists()


def test_a_users_own_token_variable_is_used_for_their_cluster(tmp_path: Path) -> None:
    # the user's environment is read as the process found it, so this runs in a process of its own
    code = (
        "from pathlib import Path; from kbit_core import ray_env; "
        "print(ray_env.join_token_file('ray://10.1.2.3:10001', None, None, Path('/nonexistent/auth_token')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "users-token")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_activate_turns_token_mode_on_in_a_ray_imported_before(tmp_path: Path) -> None:
    # Ray read RAY_AUTH_MODE=disabled at its import; kbit's environment must still win afterwards
    token = ray_env.create_token(tmp_path / "auth_token")
    code = (
        "import ray\n"
        "from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode\n"
        "assert get_authentication_mode() != AuthenticationMode.TOKEN\n"
        "from pathlib import Path\n"
        "from kbit_core import ray_env\n"
        f"ray_env.activate(ray_env.ray_env(Path({str(token)!r}), loopback=True))\n"
        "import ray._private.ray_constants as constants\n"
        "print(get_authentication_mode() == AuthenticationMode.TOKEN, constants.ENABLE_RAY_CLUSTER,\n"
        "      AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=False))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "True"]


def test_every_ray_node_kbit_starts_stops_without_rays_serve_drain(tmp_path: Path) -> None:
    """Ray 2.60's `ray start --block` drains a node for up to 30 s on SIGTERM unless told not to; the stack's head
    and the bed's head and worker nodes run no Serve replicas, so each must start with the drain off."""
    node = Host("node1", "10.213.7.2", "kbit-node1")
    token = tmp_path / "token"
    nodes = [
        ray_head(KbitConfig.model_validate({"workdir": str(tmp_path)})),
        ray_cluster.head_service(tmp_path, node, 6379, 10001, 1, 64, {}, token),
        ray_cluster.worker_service(tmp_path, node, "10.213.7.2:6379", 1, 64, {}, token),
    ]
    assert [service.env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S") for service in nodes] == ["0", "0", "0"]
